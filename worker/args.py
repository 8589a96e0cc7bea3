"""Command-line flags of `python -m worker.train` (ezpz fsdp_tp's names where they overlap)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from contracts import inject
from contracts.env_names import ENV_INJECT
from contracts.intervals import AUTO
from worker.errors import UsageError
from worker.guard import ACTIONS, MAX_SKIP_BATCHES, GuardConfig, parse_ranges
from worker.layout import Layout, check_model_fits, plan_layout
from worker.presets import PRESETS, ModelConfig, resolve_config

PROG = "python -m worker.train"


@dataclass(frozen=True)
class TrainArgs:
    model: str
    dim: int | None
    n_layers: int | None
    n_heads: int | None
    n_kv_heads: int | None
    ffn_dim: int | None
    vocab_size: int | None
    seq_len: int | None
    batch_size: int
    tp: int
    replicate: int
    device: str
    meta_init: str
    train_iters: int
    lr: float
    min_lr_ratio: float
    warmup_iters: int | None
    weight_decay: float
    grad_clip: float
    seed: int
    data_path: str | None
    data_dtype: str
    outdir: str
    pg_timeout: float
    log_every: int
    ckpt_dir: str | None
    save_interval: int | str  # steps, or "auto"
    no_resume: bool
    ckpt_keep: int
    ckpt_verify: str
    save_on_exit: bool
    async_ckpt: bool
    ckpt_stage_dir: str | None
    mem_ckpt_interval: int | str  # steps, or "auto"
    mem_partner: str
    metrics_all_ranks: bool
    guard: str = "skip"
    guard_factor: float = 4.0
    guard_grad_factor: float = 10.0
    guard_warmup: int = 20
    guard_skip_batches: int = 1
    skip_batches: str = ""
    mtbf_prior_s: float = 3600.0


class _DefaultsFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, where it has one to show (a switch that is off
    and a value that is unset say so in their help instead)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default is False  # not 0: it is a value
        if "%(default)" in text or "default:" in text or unset:
            return text
        if action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Turns argparse's exit into a UsageError, so only rank 0 prints it, on one line."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def interval(text: str) -> int | str:
    """An interval flag's value: a number of steps, or "auto" (tuned while the run goes)."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'expected a number of steps or "{AUTO}", got {text!r}'
        ) from None


def refusal(exc: UsageError) -> str:
    """The worker's one-line refusal without the program's name and the pointer to --help: the
    words another message quotes."""
    return str(exc).removeprefix(f"{PROG}: ").removesuffix(" (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="One rank of a training job. The supervisor starts it with the config's "
        "[worker] table as these flags (ezpz fsdp_tp's names where they overlap).",
        epilog=f"Tests make a rank fail on purpose through the environment, not flags: "
        f"{ENV_INJECT}=name=value,... (e.g. rank=1,raise_at_step=5), with the points "
        f"{', '.join(name for name, _, _ in inject.describe())} (docs/architecture.md).",
        formatter_class=_DefaultsFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default="debug", help=f"preset: {', '.join(PRESETS)}")
    for name in ("dim", "n-layers", "n-heads", "n-kv-heads", "ffn-dim", "vocab-size", "seq-len"):
        m.add_argument(f"--{name}", type=int, default=None, help="default: the preset's")
    m.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel rank")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    par.add_argument("--replicate", type=int, default=1, help="HSDP replicas (1: plain FSDP)")
    par.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "xpu"),
        default="auto",
        help="where the model runs (auto: an accelerator when there is one, else the CPU)",
    )
    par.add_argument(
        "--meta-init",
        choices=("auto", "on", "off"),
        default="auto",
        help="build on the meta device and materialise only local shards "
        "(auto: on from ~6e9 parameters)",
    )
    par.add_argument(
        "--pg-timeout", type=float, default=600.0, help="process-group timeout in seconds"
    )
    t = p.add_argument_group("training")
    t.add_argument("--train-iters", type=int, default=100, help="the step the job ends at")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    t.add_argument(
        "--min-lr-ratio",
        type=float,
        default=0.1,
        help="the cosine schedule ends at lr x this",
    )
    t.add_argument(
        "--warmup-iters", type=int, default=None, help="linear warm-up steps (default: 10%% of "
        "--train-iters)"
    )  # fmt: skip
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    t.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    t.add_argument("--seed", type=int, default=0, help="model init and synthetic data")
    t.add_argument(
        "--data-path",
        default=None,
        help="flat binary file of token ids (default: synthetic tokens from --seed)",
    )
    t.add_argument(
        "--data-dtype",
        choices=("uint16", "uint32"),
        default="uint16",
        help="the token ids' type in --data-path",
    )
    t.add_argument("--outdir", default="outputs", help="metrics when ES_ATTEMPT_DIR is unset")
    t.add_argument("--log-every", type=int, default=1, help="human line every N steps (rank 0)")
    t.add_argument(
        "--metrics-all-ranks",
        action="store_true",
        help="every rank writes metrics-<rank>.jsonl (default: rank 0 only)",
    )
    c = p.add_argument_group("checkpoints")
    c.add_argument(
        "--ckpt-dir",
        default=None,
        help="where checkpoints go and are resumed from; without it nothing is saved or "
        "resumed (the supervisor gives RUN_DIR/ckpt)",
    )
    c.add_argument(
        "--save-interval",
        type=interval,
        default=0,
        help="a checkpoint every N steps (0: none; auto: Young/Daly from what a save costs and "
        "how often the job fails, tuned while it runs)",
    )
    c.add_argument(
        "--no-resume", action="store_true", help="start fresh even if a checkpoint exists"
    )
    c.add_argument(
        "--ckpt-keep", type=int, default=3, help="complete checkpoints kept; older ones removed"
    )
    c.add_argument(
        "--ckpt-verify",
        choices=("size", "crc"),
        default="size",
        help="what a resume checks of each file of a checkpoint before loading it: its size, "
        "or its size and CRC32",
    )
    c.add_argument(
        "--save-on-exit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="checkpoint at the last step and on SIGTERM/SIGUSR1",
    )
    c.add_argument(
        "--async-ckpt",
        action="store_true",
        help="stage to host memory, write to --ckpt-stage-dir and copy to --ckpt-dir in the "
        "background; mark as soon as every rank's copy is done",
    )
    c.add_argument(
        "--ckpt-stage-dir",
        default=None,
        help="node-local scratch for --async-ckpt (default: <tmp>/es-ckpt-<job>)",
    )
    c.add_argument(
        "--mem-ckpt-interval",
        type=interval,
        default=AUTO,
        help="every N steps copy this rank's state into node-local shared memory (two slots, "
        "under $ES_MEM_ROOT or /dev/shm), which outlives the ranks: a relaunch on the same "
        "nodes resumes from it when it is newer than the newest durable checkpoint (0: off; "
        "auto: Young/Daly from what a copy costs and how often the job fails, tuned while it "
        "runs; off without --ckpt-dir)",
    )
    c.add_argument(
        "--mtbf-prior-s",
        type=float,
        default=3600.0,
        help="the job's mean time between failures, in seconds, that auto intervals assume "
        "until failures are seen (a run without the supervisor sees none)",
    )
    c.add_argument(
        "--mem-partner",
        choices=("on", "off"),
        default="on",
        help="with --mem-ckpt-interval on two nodes or more: each copy is also sent to a rank "
        "of the next node, which holds it in its memory, so that a node's loss loses no copy",
    )
    add_guard_flags(p)
    return p


def add_guard_flags(p: argparse.ArgumentParser) -> None:
    """The numerical guard (worker.guard) and the data positions a run skips."""
    g = p.add_argument_group("numerical guard")
    g.add_argument(
        "--guard",
        choices=ACTIONS,
        default="skip",
        help="what a bad step (a non-finite loss or gradient, or a spike) does: it is never "
        "applied; skip: its batch is dropped and the step redone with the next; rollback: "
        "the newest checkpoint is reloaded and the batches since it skipped; off: no checks",
    )
    g.add_argument(
        "--guard-factor",
        type=float,
        default=4.0,
        help="a mean loss above its running baseline x this is a spike",
    )
    g.add_argument(
        "--guard-grad-factor",
        type=float,
        default=10.0,
        help="a global gradient norm (before clipping) above its running baseline x this is a "
        "spike",
    )
    g.add_argument(
        "--guard-warmup",
        type=int,
        default=20,
        help="good steps before spikes are judged, and the baseline's averaging window",
    )
    g.add_argument(
        "--guard-skip-batches",
        type=int,
        default=1,
        help="rollback: skip at least this many data positions from the checkpoint's on",
    )
    g.add_argument(
        "--skip-batches",
        default="",
        metavar="A-B[,C-D]",
        help="data positions no step trains on, from the start (positions count from 1; a "
        "checkpoint records the ranges it skipped, so a run given them reproduces it)",
    )


def guard_config(a: TrainArgs) -> GuardConfig:
    return GuardConfig(
        a.guard, a.guard_factor, a.guard_grad_factor, a.guard_warmup, a.guard_skip_batches
    )


def check_guard(a: TrainArgs) -> None:
    for flag, value in (
        ("--guard-factor", a.guard_factor),
        ("--guard-grad-factor", a.guard_grad_factor),
    ):
        if not (math.isfinite(value) and value > 1):
            raise UsageError(f"{flag} must be a number above 1, got {value}")
    if a.guard_warmup < 1:
        raise UsageError(f"--guard-warmup must be at least 1, got {a.guard_warmup}")
    if not 1 <= a.guard_skip_batches <= MAX_SKIP_BATCHES:
        raise UsageError(
            f"--guard-skip-batches must be 1 to {MAX_SKIP_BATCHES:,} data positions, got "
            f"{a.guard_skip_batches}"
        )
    try:
        parse_ranges(a.skip_batches)
    except ValueError as exc:
        raise UsageError(f"--skip-batches: {exc}") from None


def parse_args(argv: list[str] | None) -> TrainArgs:
    ns = build_parser().parse_args(argv)
    args = TrainArgs(**{f.name: getattr(ns, f.name) for f in fields(TrainArgs)})
    check_args(args)
    return args


def check_args(a: TrainArgs) -> None:
    """Pure checks of values that no layout or file can make right."""
    if a.model not in PRESETS:
        raise UsageError(
            f"--model: unknown model preset {a.model!r}; choose one of {', '.join(PRESETS)}"
        )
    positive = {
        "--batch-size": a.batch_size,
        "--train-iters": a.train_iters,
        "--ckpt-keep": a.ckpt_keep,
        "--log-every": a.log_every,
    }
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    at_least_zero = {
        "--lr": a.lr,
        "--weight-decay": a.weight_decay,
    }
    for flag, value in at_least_zero.items():
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{flag} must be a number >= 0, got {value}")
    for flag, value in (("--grad-clip", a.grad_clip), ("--pg-timeout", a.pg_timeout)):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag} must be a number > 0, got {value}")
    if not (math.isfinite(a.min_lr_ratio) and 0 <= a.min_lr_ratio <= 1):
        raise UsageError(f"--min-lr-ratio must be between 0 and 1, got {a.min_lr_ratio}")
    if a.warmup_iters is not None and a.warmup_iters < 0:
        raise UsageError(f"--warmup-iters must be 0 or more, got {a.warmup_iters}")
    if a.save_interval != AUTO and a.save_interval < 0:
        raise UsageError(f"--save-interval must be 0 (off) or positive, got {a.save_interval}")
    if a.mem_ckpt_interval != AUTO and a.mem_ckpt_interval < 0:
        raise UsageError(
            f"--mem-ckpt-interval must be 0 (off) or positive, got {a.mem_ckpt_interval}"
        )
    if not (math.isfinite(a.mtbf_prior_s) and a.mtbf_prior_s > 0):
        raise UsageError(f"--mtbf-prior-s must be seconds > 0, got {a.mtbf_prior_s}")
    check_guard(a)
    # "auto" for the memory tier (its default) means off without --ckpt-dir.
    memory = a.mem_ckpt_interval != AUTO and a.mem_ckpt_interval
    if (a.save_interval or a.async_ckpt or memory) and not a.ckpt_dir:
        raise UsageError(
            "--save-interval, --async-ckpt and --mem-ckpt-interval need --ckpt-dir (the memory "
            "tier is lost with a node and never replaces the durable one)"
        )


def plan_run(a: TrainArgs, world: int) -> tuple[ModelConfig, Layout]:
    """The model's sizes and the mesh for `world` ranks: every check that needs neither a
    process group nor torch (the supervisor runs it before launching anything)."""
    cfg = resolve_config(
        a.model,
        dim=a.dim,
        n_layers=a.n_layers,
        n_heads=a.n_heads,
        n_kv_heads=a.n_kv_heads,
        ffn_dim=a.ffn_dim,
        vocab_size=a.vocab_size,
        seq_len=a.seq_len,
    )
    if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise UsageError(
            f"--dim {cfg.dim} must divide by --n-heads {cfg.n_heads}, and "
            f"--n-heads by --n-kv-heads {cfg.n_kv_heads}"
        )
    if cfg.head_dim % 2:
        raise UsageError(
            f"--dim {cfg.dim} / --n-heads {cfg.n_heads} = {cfg.head_dim} per head must be even "
            "(rotary embeddings rotate pairs)"
        )
    layout = plan_layout(world, a.tp, a.replicate)
    check_model_fits(layout, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim)
    return cfg, layout
