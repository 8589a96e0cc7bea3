"""`python -m worker.train`: FSDP / HSDP / FSDP+TP training of an agpt model.

Runs under mpiexec, srun, torchrun or the supervisor; saves sharded checkpoints and resumes from
the newest complete one on start. Exit status: 0 finished or stopped gracefully, 2 bad input,
1 anything else (after bringing the whole job down).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from supervisor.protocol import ENV_ATTEMPT_DIR
from worker.args import TrainArgs, parse_args, plan_run
from worker.beat import Beacon, StepFaults
from worker.dist import RankInfo, abort_job, detect_rank
from worker.errors import UsageError
from worker.startup import Startup

META_INIT_AUTO_PARAMS = 6e9
PEER_ERROR_GRACE_S = 5.0  # a rank other than 0 waits this long before reporting a usage error


class StopRequest:
    """SIGTERM / SIGUSR1 ask for a checkpoint at the end of the current step, then exit 0."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


def metrics_dir(args: TrainArgs) -> Path:
    return Path(os.environ.get(ENV_ATTEMPT_DIR) or args.outdir)


def check_paths(args: TrainArgs) -> None:
    """Fail early, before any rank waits on another, on directories that cannot be written."""
    for label, raw in (("output", str(metrics_dir(args))), ("--ckpt-dir", args.ckpt_dir)):
        if raw is None:
            continue
        path = Path(raw)
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise UsageError(
                f"{label} directory {path} is not writable ({exc.strerror}); choose a writable path"
            ) from None


def main(argv: list[str] | None = None) -> int:
    info = detect_rank(os.environ)
    stop = StopRequest()  # early: a stop asked for during start-up is honoured after step one
    say = print if info.rank == 0 else (lambda *a, **k: None)
    try:
        args = parse_args(argv)
        check_paths(args)
        setup = plan(args, info)
    except UsageError as exc:
        say(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    beacon = Beacon.from_env(info.rank, info.world)
    beacon.hello("init")
    try:
        return run(args, info, setup, beacon, say, stop)
    except UsageError as exc:
        if info.rank != 0:
            # Most such errors (another model's checkpoint, say) hit every rank at once: give
            # rank 0 the time to print the one line and end the job, else say it here.
            time.sleep(PEER_ERROR_GRACE_S)
            print(f"error (rank {info.rank}): {exc}", file=sys.stderr, flush=True)
        say(f"error: {exc}", file=sys.stderr, flush=True)
        beacon.error(str(exc))
        beacon.close()
        abort_job(info, exc.exit_code)
    except BaseException as exc:  # a bug or a broken peer: bring every rank down, never hang
        traceback.print_exc()
        beacon.error(f"{type(exc).__name__}: {exc}")
        beacon.close()
        abort_job(info, 1)
    return 1


def plan(args: TrainArgs, info: RankInfo):
    """Checks that need no process group: model sizes, the mesh, the token file."""
    cfg, layout = plan_run(args, info.world)
    if args.data_path is not None and not Path(args.data_path).is_file():
        raise UsageError(
            f"token file {args.data_path} does not exist; pass --data-path to a "
            f"file of {args.data_dtype} token ids"
        )
    return cfg, layout


def lr_lambda(args: TrainArgs):
    warmup = args.warmup_iters if args.warmup_iters is not None else max(1, args.train_iters // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, args.train_iters - warmup))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine

    return factor


def run(args: TrainArgs, info: RankInfo, setup, beacon: Beacon, say, stop: StopRequest) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from worker import data as data_mod
    from worker.ckpt.checkpointer import Checkpointer, RunIdentity
    from worker.ckpt.manager import AsyncSaves
    from worker.dist import init_process_group, select_device, set_threads
    from worker.metrics import MetricsLog, human_line
    from worker.parallel import build_mesh, clip_grad_norm

    startup = Startup()
    startup.mark("imports")
    cfg, layout = setup
    # DTensor warns on every step that a 2-D grad norm takes two all-reduces; known, harmless.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device_type, backend = select_device(args.device)
    threads = set_threads(info)
    device = init_process_group(info, backend, device_type, args.pg_timeout)
    mesh = build_mesh(layout, device_type)
    startup.mark("process_group")
    meta_init = args.meta_init == "on" or (
        args.meta_init == "auto" and cfg.num_params() >= META_INIT_AUTO_PARAMS
    )
    say(
        f"agpt {cfg.describe()} ({cfg.num_params() / 1e6:.1f}M params) on {info.world} ranks "
        f"[{layout.describe()}] device={device_type} backend={backend} threads={threads} "
        f"meta_init={meta_init}",
        flush=True,
    )

    identity = RunIdentity(cfg.fingerprint(), cfg.describe(), info.world, layout.describe())
    resume_from = choose_resume(args, info, identity, beacon, say)  # read while building
    startup.mark("choose")

    model = build_model(cfg, mesh, layout, device, meta_init, args.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    if args.data_path:
        source = data_mod.TokenFileData(
            args.data_path, args.data_dtype, cfg.vocab_size, cfg.seq_len, args.seed
        )
    else:
        source = data_mod.SyntheticData(cfg.vocab_size, cfg.seq_len, args.seed)
    data_desc = {"kind": type(source).__name__, "path": args.data_path, "seed": args.seed}
    dp_rank = layout.dp_rank(info.rank)
    tokens_per_step = args.batch_size * layout.dp * cfg.seq_len

    write_metrics = info.rank == 0 or args.metrics_all_ranks
    out_dir = metrics_dir(args)
    metrics = MetricsLog(out_dir / f"metrics-{info.rank}.jsonl" if write_metrics else None)
    startup.mark("model_build")
    # What the imports and the model made lives as long as the process; a full garbage
    # collection walked it all for 0.2-0.33 s here (once inside a checkpoint load, stalling
    # that rank and so every rank). Frozen, later collections skip it.
    gc.freeze()

    ckpt = None
    start_step, tokens_seen, resumed = 0, 0, False
    if args.ckpt_dir:
        ckpt = Checkpointer(
            Path(args.ckpt_dir),
            rank=info.rank,
            world=info.world,
            device_type=device_type,
            identity=identity,
            keep=args.ckpt_keep,
            verify=args.ckpt_verify,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            after_write=lambda step: inject_in_save(args, info, step),
        )
        if resume_from is not None:
            state = ckpt.load(resume_from)
            start_step, tokens_seen, resumed = state.step, state.tokens_seen, True
            say(f"RESUMED from step={start_step} ({resume_from})", flush=True)

    startup.mark("load")
    saver = AsyncSaves(args, info, ckpt, metrics, beacon, say) if ckpt and args.async_ckpt else None

    def save(step: int) -> None:
        beacon.phase("save", step)
        data = {**data_desc, "next_step": step + 1}
        if saver is not None:
            saver.save(step, tokens_seen, data)
            beacon.phase("train", step)
            return
        seconds = ckpt.save(step, tokens_seen, data)
        metrics.add_to_next("train/ckpt_save_seconds", seconds)
        beacon.ckpt(step, "complete")
        say(f"checkpoint step={step} saved in {seconds:.2f}s", flush=True)
        beacon.phase("train", step)

    beacon.phase("train", start_step)
    step = start_step
    first = True
    in_step_faults = StepFaults(beacon)  # faults/: stall or slow this rank when told to
    while step < args.train_iters:
        step += 1
        started = time.perf_counter()
        inject(args, info, step)
        in_step_faults.apply()
        inputs, targets = data_mod.batch(source, step, dp_rank, args.batch_size)
        logits = model(inputs.to(device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
        loss.backward()
        clip_grad_norm(model.parameters(), args.grad_clip)
        if saver is not None:
            saver.before_update()  # a save's staging copy ran beside forward and backward
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # One small collective carries both the mean loss and whether any rank was asked to
        # stop, so every rank stops after the same step.
        shared = torch.tensor([loss.item(), float(stop.requested)], dtype=torch.float64)
        dist.all_reduce(shared)
        mean_loss = shared[0].item() / info.world
        stopping = shared[1].item() > 0
        tokens_seen += tokens_per_step
        dt = time.perf_counter() - started
        if first:
            startup.mark("first_step")
            for name, seconds in startup.parts.items():
                metrics.add_to_next(name, seconds)
            metrics.add_to_next("train/startup_seconds", startup.total)
            if resumed:
                metrics.add_to_next("train/restart_seconds", startup.total)
                beacon.resumed(start_step, startup.total)
            first = False
        entry = metrics.record(step, mean_loss, dt, tokens_per_step)
        beacon.step(step, mean_loss, dt)
        if info.rank == 0 and (step % args.log_every == 0 or step == args.train_iters):
            print(human_line(entry, args.train_iters), flush=True)
        if saver is not None:
            saver.poll(step)  # mark a save in flight as soon as every rank's copy is done
        last = step == args.train_iters
        periodic = args.save_interval and step % args.save_interval == 0
        if ckpt is not None and (periodic or ((last or stopping) and args.save_on_exit)):
            save(step)
        if stopping:
            say(f"stop requested: exiting after step {step}", flush=True)
            break

    if saver is not None:
        saver.finish(step)  # drain and mark before exit
    finished = step >= args.train_iters
    beacon.phase("done", step)
    if finished:
        beacon.done(step)
    metrics.close()
    beacon.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def choose_resume(args: TrainArgs, info: RankInfo, identity, beacon: Beacon, say) -> Path | None:
    """The checkpoint to resume from, if any, chosen before the model is built so that its
    files are read into the page cache meanwhile."""
    from worker.ckpt.checkpointer import choose_checkpoint, start_reading
    from worker.ckpt.files import read_meta

    if not args.ckpt_dir or args.no_resume:
        return None
    beacon.phase("load", 0)
    chosen = choose_checkpoint(
        Path(args.ckpt_dir),
        rank=info.rank,
        verify=args.ckpt_verify,
        log=lambda m: say(m, flush=True),
    )
    if chosen is None:
        say(f"no complete checkpoint in {args.ckpt_dir}: starting fresh", flush=True)
    else:
        start_reading(chosen, read_meta(chosen), rank=info.rank, identity=identity)
    return chosen


def build_model(cfg, mesh, layout, device, meta_init: bool, seed: int):
    """Dense: build whole, initialise, shard (bit-exact with a one-process run). Meta: build
    shapes only, shard, then allocate and initialise just this rank's shards."""
    import torch

    from worker.model import Transformer
    from worker.parallel import materialize, parallelize

    torch.manual_seed(seed)
    if meta_init:
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize(model, mesh, layout)
        materialize(model, device)
        return model
    with torch.device(device):
        model = Transformer(cfg)
        model.init_weights()
    return parallelize(model, mesh, layout)


def inject(args: TrainArgs, info: RankInfo, step: int) -> None:
    """Test hooks: fail or stall one rank inside a chosen step."""
    if info.rank != args.inject_rank:
        return
    if step == args.inject_raise_at_step:
        raise RuntimeError(f"injected failure at step {step}")
    if step == args.inject_stall_at_step:
        while True:  # blocked inside the step; the beat thread keeps beating
            time.sleep(1)


def inject_in_save(args: TrainArgs, info: RankInfo, step: int) -> None:
    if info.rank == args.inject_rank and step == args.inject_kill_in_save_at_step:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
