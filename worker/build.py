"""Everything a run trains with, built once: the process group and mesh, the model, optimizer,
scheduler, data, metrics and checkpoint manager, and the checkpoint state it resumes from.

Two halves: `join_group` + `build_state` need no checkpoint (a warm standby runs them before it
is told to go, worker.standby); `resume_from` creates the checkpoint manager and loads the chosen
checkpoint. A cold start (`build`) chooses the checkpoint between the two halves of the first,
before the model is built, so its files are read meanwhile. Each part's seconds go to a
`startup/*` metric.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from contracts.intervals import AUTO, DURABLE, MEMORY
from worker import guard
from worker.args import TrainArgs, guard_config
from worker.beat import Beacon
from worker.ckpt import owner, resume
from worker.ckpt.checkpointer import Resumed
from worker.ckpt.manager import CheckpointManager, create_manager
from worker.ckpt.settings import CkptSettings
from worker.data import SyntheticData, TokenFileData
from worker.dist import RankInfo, init_process_group, select_device, set_threads
from worker.guard_step import GuardRun
from worker.hooks import Hooks
from worker.intervals import Intervals
from worker.layout import Layout
from worker.metrics import MetricsLog, metrics_dir
from worker.model import Transformer
from worker.parallel import build_mesh, materialize, parallelize
from worker.presets import ModelConfig
from worker.startup import Startup

META_INIT_AUTO_PARAMS = 6e9


@dataclass(frozen=True)
class Setup:
    """What every part of the build reads: the flags, this rank, the model, the mesh's layout,
    where to report."""

    args: TrainArgs
    info: RankInfo
    cfg: ModelConfig
    layout: Layout
    beacon: Beacon
    say: Callable[..., None]  # prints on rank 0 only
    startup: Startup
    hooks: Hooks = field(default_factory=Hooks)  # where a test makes this rank fail

    @property
    def ckpt(self) -> CkptSettings:
        return ckpt_settings(self.args)


def ckpt_settings(args: TrainArgs) -> CkptSettings:
    """What the checkpoint code needs of the run's flags."""
    return CkptSettings(
        ckpt_dir=args.ckpt_dir,
        keep=args.ckpt_keep,
        verify=args.ckpt_verify,
        start_fresh=args.no_resume,
        async_save=args.async_ckpt,
        stage_dir=args.ckpt_stage_dir,
        mem_interval=memory_interval(args),
        mem_partner=args.mem_partner == "on",
        timeout_s=args.pg_timeout,
    )


def memory_interval(args: TrainArgs) -> int:
    """The memory tier's interval as given, 0 when there is none: "auto" is on with a
    checkpoint dir, 1 standing for it (the loop says when a copy is due: worker.intervals)."""
    if args.mem_ckpt_interval == AUTO:
        return 1 if args.ckpt_dir else 0
    return int(args.mem_ckpt_interval)


def intervals_of(args: TrainArgs, rank: int) -> Intervals:
    """The run's checkpoint intervals: a number, or "auto" (started by the supervisor's
    `ES_*_INTERVAL` when set)."""
    return Intervals(
        {MEMORY: args.mem_ckpt_interval, DURABLE: args.save_interval},
        rank=rank,
        memory_on=memory_interval(args) > 0,
        prior_mtbf_s=args.mtbf_prior_s,
        max_steps=args.train_iters,
        env=os.environ,
    )


@dataclass
class Group:
    """This rank in its process group: what `join_group` sets up."""

    device_type: str
    device: torch.device
    mesh: Any  # DeviceMesh
    identity: resume.RunIdentity
    meta_init: bool


@dataclass
class State:
    """What a run trains, before any checkpoint is loaded into it: `build_state`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    source: SyntheticData | TokenFileData
    metrics: MetricsLog
    hooks: Hooks
    drawn: bool = True  # the parameters hold their initial values (else zeros: `defers_init`)


@dataclass
class Training:
    """What the training loop works with."""

    args: TrainArgs
    info: RankInfo
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    source: SyntheticData | TokenFileData
    data_desc: dict[str, Any]  # what a checkpoint records of the data, besides the position
    dp_rank: int
    tokens_per_step: int
    metrics: MetricsLog
    ckpt: CheckpointManager
    resumed: Resumed | None
    beacon: Beacon
    hooks: Hooks
    say: Callable[..., None]  # prints on rank 0 only
    startup: Startup
    guard: GuardRun  # the numerical guard: skipped data positions, baseline (worker.guard_step)
    intervals: Intervals  # when the memory tier copies and the durable tier saves

    @property
    def start_step(self) -> int:
        return self.resumed.step if self.resumed else 0

    @property
    def start_tokens(self) -> int:
        return self.resumed.tokens_seen if self.resumed else 0

    def data_position(self, step: int) -> dict[str, Any]:
        """The data record of a checkpoint saved at the end of `step`: with the data positions
        skipped so far and the guard's baseline (a resumed run goes on with both)."""
        return {**self.data_desc, "next_step": step + 1, **self.guard.record()}


def build(setup: Setup) -> Training:
    """A cold start: the group, the checkpoint chosen (its files read ahead while the model is
    built), the model and the rest, then the load."""
    group = join_group(setup)
    chosen = choose(setup, group)
    state = build_state(setup, group, draw=chosen.source is None or not defers_init(group))
    return resume_from(setup, group, state, chosen)


def join_group(setup: Setup) -> Group:
    """Collective: the process group and mesh; rank 0 holds the checkpoint dir of a run by hand."""
    args, info, cfg, layout = setup.args, setup.info, setup.cfg, setup.layout
    # DTensor warns on every step that a 2-D grad norm takes two all-reduces; known, harmless.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device_type, backend = select_device(args.device)
    threads = set_threads(info)
    device = init_process_group(info, backend, device_type, args.pg_timeout)
    mesh = build_mesh(layout, device_type)
    if args.ckpt_dir:  # every rank has checked it by now: they are all in the group
        owner.hold_if_alone(Path(args.ckpt_dir), info.rank)
    setup.startup.mark("process_group")
    meta_init = args.meta_init == "on" or (
        args.meta_init == "auto" and cfg.num_params() >= META_INIT_AUTO_PARAMS
    )
    setup.say(
        f"agpt {cfg.describe()} ({cfg.num_params() / 1e6:.1f}M params) on {info.world} ranks "
        f"[{layout.describe()}] device={device_type} backend={backend} threads={threads} "
        f"meta_init={meta_init}",
        flush=True,
    )
    identity = resume.RunIdentity(cfg.fingerprint(), cfg.describe(), info.world, layout.describe())
    return Group(device_type, device, mesh, identity, meta_init)


def choose(setup: Setup, group: Group) -> resume.Chosen:
    """Collective: the checkpoint to resume (None: start fresh); its files start to be read."""
    info = setup.info
    chosen = resume.choose(
        setup.ckpt, info.rank, group.identity, setup.beacon, setup.say, info.host
    )
    setup.startup.mark("choose")
    return chosen


def defers_init(group: Group) -> bool:
    """Whether a start that may resume leaves the initial values undrawn until it knows it does
    not: on CPU, the dense build draws the whole model on every rank (0.06 s of CPU per rank on
    the debug preset, thrown away by every load). The meta build draws only
    this rank's shards, and on an accelerator drawing is cheap."""
    return group.device_type == "cpu" and not group.meta_init


def build_state(setup: Setup, group: Group, draw: bool = True) -> State:
    """The model (seeded: every start builds the same one; without `draw`, zeros until
    `resume_from` finds nothing to load), optimizer, scheduler, data, metrics and test hooks."""
    args, info, cfg = setup.args, setup.info, setup.cfg
    model = build_model(
        cfg, group.mesh, setup.layout, group.device, group.meta_init, args.seed, draw
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    if args.data_path:
        source = TokenFileData(
            args.data_path, args.data_dtype, cfg.vocab_size, cfg.seq_len, args.seed
        )
    else:
        source = SyntheticData(cfg.vocab_size, cfg.seq_len, args.seed)
    write_metrics = info.rank == 0 or args.metrics_all_ranks
    path = metrics_dir(args) / f"metrics-{info.rank}.jsonl"
    metrics = MetricsLog(path if write_metrics else None)
    setup.startup.mark("model_build")
    # What the imports and the model made lives as long as the process; a full garbage
    # collection walked it all for 0.2-0.33 s here (once inside a checkpoint load, stalling
    # that rank and so every rank). Frozen, later collections skip it.
    gc.freeze()
    drawn = draw or not defers_init(group)  # the meta build always draws
    return State(model, optimizer, scheduler, source, metrics, setup.hooks, drawn=drawn)


def resume_from(setup: Setup, group: Group, state: State, chosen: resume.Chosen) -> Training:
    """Collective: the checkpoint manager (the async mode cleans the node's stage dir and makes
    its own groups: only once the run really goes), the load of `chosen`, the manager started."""
    args, info = setup.args, setup.info
    ckpt = create_manager(
        setup.ckpt,
        info,
        identity=group.identity,
        device_type=group.device_type,
        model=state.model,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
        metrics=state.metrics,
        beacon=setup.beacon,
        say=setup.say,
        hooks=state.hooks,
        data_check=guard.record_problem,  # the record is the loop's: its guard judges it
    )
    resumed = ckpt.load(chosen)
    if resumed is None and not state.drawn:  # nothing loaded after all: a fresh start's values
        draw_fresh(setup, group, state.model)
    setup.startup.mark("load")
    ckpt.start()
    return Training(
        args=args,
        info=info,
        device=group.device,
        model=state.model,
        optimizer=state.optimizer,
        scheduler=state.scheduler,
        source=state.source,
        data_desc={"kind": type(state.source).__name__, "path": args.data_path, "seed": args.seed},
        dp_rank=setup.layout.dp_rank(info.rank),
        tokens_per_step=args.batch_size * setup.layout.dp * setup.cfg.seq_len,
        metrics=state.metrics,
        ckpt=ckpt,
        resumed=resumed,
        beacon=setup.beacon,
        hooks=state.hooks,
        say=setup.say,
        startup=setup.startup,
        guard=GuardRun.start(
            guard_config(args),
            args.skip_batches,
            resumed.data if resumed is not None else None,
            state.hooks.numeric_faults(),
            resumed.step if resumed is not None else 0,
        ),
        intervals=intervals_of(args, info.rank),
    )


def build_model(
    cfg, mesh, layout, device, meta_init: bool, seed: int, draw: bool = True
) -> torch.nn.Module:
    """Dense: allocate whole, initialise (`draw`: else zeros), shard (bit-exact with a
    one-process run). Meta: shard first, then allocate and initialise just this rank's shards.
    Both build the shapes on the meta device: `init_weights` sets every parameter, so the
    layers' own initialisation was thrown away (a third of the build's CPU on the debug preset,
    in every start and standby)."""
    model = shapes_on_meta(cfg, seed)
    if meta_init:
        parallelize(model, mesh, layout)
        materialize(model, device)
        return model
    materialize(model, device, draw)
    return parallelize(model, mesh, layout)


def shapes_on_meta(cfg, seed: int) -> Transformer:
    """The model's shapes, no memory; the seed set for the values drawn next."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        return Transformer(cfg)


def draw_fresh(setup: Setup, group: Group, model: torch.nn.Module) -> None:
    """Collective: a dense model built without drawing, given the values a cold fresh start
    draws (the same seed, the whole model drawn, then each rank's shards of it)."""
    whole = shapes_on_meta(setup.cfg, setup.args.seed)
    materialize(whole, group.device)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, whole.state_dict(), options=options)


def lr_lambda(args: TrainArgs) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to `min_lr_ratio` of the peak at the last step."""
    warmup = args.warmup_iters if args.warmup_iters is not None else max(1, args.train_iters // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, args.train_iters - warmup))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine

    return factor
