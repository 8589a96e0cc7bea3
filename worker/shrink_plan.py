"""What the worker's flags become when a job relaunches on fewer ranks (`[restart] shrink`).

Pure and torch-free: the supervisor plans the smaller world (through `worker.spec`) before it
launches anything, with the worker's own checks, so a plan the worker would refuse is a
`problem`, not a failed attempt. Tensor parallelism is kept (its groups live inside a node and
the model is split by it); the data-parallel degree shrinks, and the global batch (sequences per
step, every data-parallel rank taking `batch_size` of them: `worker.data.batch`) is kept by more
sequences per rank where the sizes divide. The worker has no gradient accumulation (it would
change the normal path's arithmetic), so where they do not divide the global batch changes and
the plan says so.

Always planned from the job's ORIGINAL flags and world: a job that shrinks twice is planned
from the first world again, never from a plan of a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from worker import args as worker_args
from worker.errors import UsageError


@dataclass(frozen=True)
class ShrinkPlan:
    """The smaller world's flags and what changed; `problem` when it cannot run at all."""

    world: int
    new_world: int
    flags: dict[str, Any] = field(default_factory=dict)  # overrides, by [worker] key (flag dest)
    changes: tuple[str, ...] = ()
    batch_kept: bool = True  # global batch in tokens per step unchanged
    global_batch: tuple[int, int] = (0, 0)  # sequences per step, before and after
    tokens_per_step: tuple[int, int] = (0, 0)
    mesh: tuple[str, str] = ("", "")  # worker.layout descriptions, before and after
    problem: str | None = None

    def event(self) -> dict[str, Any]:
        """The `shrink` event's fields (JSON-ready)."""
        return {
            "world": [self.world, self.new_world],
            "mesh": list(self.mesh),
            "flags": dict(self.flags),
            "changes": list(self.changes),
            "batch_kept": self.batch_kept,
            "global_batch": list(self.global_batch),
            "tokens_per_step": list(self.tokens_per_step),
            "problem": self.problem,
        }


def plan_shrink(argv: Sequence[str], world: int, new_world: int) -> ShrinkPlan:
    """The overrides of the worker's flags `argv` (absent flags: the worker's defaults) for
    `new_world` ranks of a job planned for `world` ranks."""
    base = list(argv)
    try:
        args = worker_args.parse_args(base)
        cfg, old = worker_args.plan_run(args, world)
    except UsageError as exc:
        why = f"the job's [worker] flags do not plan on its own {world} ranks: "
        return ShrinkPlan(world, new_world, problem=why + worker_args.refusal(exc))
    old_batch = old.dp * args.batch_size
    before = ShrinkPlan(
        world,
        new_world,
        global_batch=(old_batch, old_batch),
        tokens_per_step=(old_batch * cfg.seq_len, old_batch * cfg.seq_len),
        mesh=(old.describe(), old.describe()),
    )
    if new_world < 1:
        return _refused(before, f"no ranks left (world {world} -> {new_world})")
    tp = old.tp
    if new_world % tp:
        return _refused(
            before,
            f"tp {tp} does not divide the {new_world} ranks left (world {world} -> "
            f"{new_world}): tensor-parallel groups must stay whole; keep min_nodes x ranks "
            f"per node a multiple of {tp}, or set worker.tp to a divisor of {new_world}",
        )
    new_dp = new_world // tp
    changes = [
        f"world {world} -> {new_world} ranks: data parallel {old.dp} -> {new_dp}"
        + (f", tp {tp} kept" if tp > 1 else "")
    ]
    overrides: dict[str, Any] = {}
    replicate = old.replicate
    if new_dp % replicate:
        replicate = max(d for d in range(1, old.replicate + 1) if new_dp % d == 0)
        overrides["replicate"] = replicate
        changes.append(
            f"replicate {old.replicate} -> {replicate}: {old.replicate} HSDP replicas do not "
            f"divide the data-parallel degree {new_dp}"
        )
    batch_size, kept = args.batch_size, old_batch % new_dp == 0
    new_batch = old_batch if kept else new_dp * batch_size
    tokens = (old_batch * cfg.seq_len, new_batch * cfg.seq_len)
    if kept and old_batch // new_dp != batch_size:
        batch_size = old_batch // new_dp
        overrides["batch_size"] = batch_size
        changes.append(
            f"batch_size {args.batch_size} -> {batch_size} per data-parallel rank: global batch "
            f"kept at {old_batch} sequences ({tokens[0]} tokens) per step"
        )
    elif not kept:
        changes.append(
            f"global batch {old_batch} -> {new_batch} sequences ({tokens[0]} -> {tokens[1]} "
            f"tokens) per step: {old_batch} sequences do not divide among {new_dp} "
            f"data-parallel ranks and the worker has no gradient accumulation "
            f"(batch_size {batch_size} kept; the learning-rate schedule is per step)"
        )
    try:  # the worker's own checks, on exactly what the relaunch will pass
        _, new = worker_args.plan_run(worker_args.parse_args(base + _flags(overrides)), new_world)
    except UsageError as exc:
        return _refused(before, f"the worker refuses {new_world} ranks: {worker_args.refusal(exc)}")
    return ShrinkPlan(
        world,
        new_world,
        flags=overrides,
        changes=tuple(changes) if new_world != world else (),
        batch_kept=kept,
        global_batch=(old_batch, new_batch),
        tokens_per_step=tokens,
        mesh=(old.describe(), new.describe()),
    )


def _flags(overrides: dict[str, int]) -> list[str]:
    """The overrides as flags after the job's own: the last of a flag given twice wins."""
    return [part for k, v in overrides.items() for part in ("--" + k.replace("_", "-"), str(v))]


def _refused(before: ShrinkPlan, problem: str) -> ShrinkPlan:
    return ShrinkPlan(
        before.world,
        before.new_world,
        batch_kept=False,
        global_batch=before.global_batch,
        tokens_per_step=before.tokens_per_step,
        mesh=(before.mesh[0], ""),
        problem=problem,
    )
