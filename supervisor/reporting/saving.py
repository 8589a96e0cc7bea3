"""What saving cost: each checkpoint's stall and time to its marker, the memory tier's copies,
and the Young/Daly interval for the run's save cost and failure rate."""

from __future__ import annotations

import math
import statistics

from supervisor.reporting.load import StepRecord
from supervisor.reporting.model import Checkpoints, Interval, MemoryTier, SaveStall


def checkpoints_of(ev: list[dict], records: list[StepRecord]) -> Checkpoints:
    saves: dict[tuple[int, int], SaveStall] = {}
    order: list[SaveStall] = []
    for r in records:
        x = r.extra
        if "train/ckpt_save_seconds" in x or "train/ckpt_stage_seconds" in x:
            s = SaveStall(step=r.step - 1, attempt=r.attempt)
            s.save_s = x.get("train/ckpt_save_seconds")
            s.stage_s = x.get("train/ckpt_stage_seconds")
            s.wait_s = x.get("train/ckpt_wait_seconds")
            saves[(r.attempt, s.step)] = s
            order.append(s)
        if "train/ckpt_drain_seconds" in x:  # the oldest staged save of this attempt not drained
            pending = [
                s for s in order if s.attempt == r.attempt and s.is_async and s.drain_s is None
            ]
            if pending:
                pending[0].drain_s = x["train/ckpt_drain_seconds"]
                if "train/ckpt_marker_seconds" in x:
                    pending[0].marker_s = x["train/ckpt_marker_seconds"]
    marked = {(e.get("attempt"), e.get("step")) for e in ev if e.get("event") == "ckpt_complete"}
    # A save no later step timed (the last step's, a graceful stop's) is still a save: counted,
    # its stall unknown.
    for attempt, step in marked - set(saves):
        if isinstance(attempt, int) and isinstance(step, int):
            saves[(attempt, step)] = SaveStall(step=step, attempt=attempt)
            order.append(saves[(attempt, step)])
    order.sort(key=lambda s: (s.attempt, s.step))
    # save -> marker from the supervisor's own events: rank 0 entered `save`, then `.complete`
    began: dict[tuple[int, int], dict] = {}
    for e in ev:
        if e.get("event") == "phase" and e.get("phase") == "save":
            began[(e.get("attempt"), e.get("step"))] = e
        elif e.get("event") == "ckpt_complete":
            key = (e.get("attempt"), e.get("step"))
            s, b = saves.get(key), began.get(key)
            if s is not None and b is not None and s.marker_s is None:
                s.marker_s = e.get("mono", 0.0) - b.get("mono", 0.0)
    for s in order:  # a sync save's marker is its last act
        if s.marker_s is None and s.save_s is not None:
            s.marker_s = s.save_s

    def stat(values: list[float | None], fn) -> float | None:
        vs = [v for v in values if v is not None]
        return fn(vs) if vs else None

    med, mx = statistics.median, max
    stalls = [s.stall_s for s in order if s.timed]
    return Checkpoints(
        count=len(marked) if marked else len(order),
        saves=order,
        save_median_s=stat([s.save_s for s in order], med),
        save_max_s=stat([s.save_s for s in order], mx),
        stage_median_s=stat([s.stage_s for s in order], med),
        stage_max_s=stat([s.stage_s for s in order], mx),
        drain_median_s=stat([s.drain_s for s in order], med),
        drain_max_s=stat([s.drain_s for s in order], mx),
        stall_median_s=stat(stalls, med),
        stall_max_s=stat(stalls, mx),
        stall_total_s=sum(stalls),
        marker_median_s=stat([s.marker_s for s in order], med),
        marker_max_s=stat([s.marker_s for s in order], mx),
    )


MEM_STALL = "train/mem_ckpt_stall_seconds"
MEM_COPY = "train/mem_ckpt_copy_seconds"


def memory_tier(records: list[StepRecord]) -> MemoryTier | None:
    """The memory tier's copies from the rank-0 metrics (each on the record after its step)."""
    stalls = [r.extra[MEM_STALL] for r in records if MEM_STALL in r.extra]
    if not stalls:
        return None
    copies = [r.extra[MEM_COPY] for r in records if MEM_COPY in r.extra]
    return MemoryTier(
        copies=len(stalls),
        stall_total_s=sum(stalls),
        stall_median_s=statistics.median(stalls),
        stall_max_s=max(stalls),
        copy_total_s=sum(copies),
        copy_median_s=statistics.median(copies) if copies else None,
        copy_max_s=max(copies) if copies else None,
    )


def young_daly(
    save_cost: float | None,
    wall: float,
    n_failures: int,
    step_s: float | None,
    interval_steps: int | None,
) -> Interval | None:
    """The optimal interval for this run's save cost and failure rate (None without both)."""
    if not save_cost or not n_failures or not step_s or not interval_steps or wall <= 0:
        return None
    mtbf = wall / n_failures
    young = math.sqrt(2 * save_cost * mtbf)
    daly = young - save_cost if save_cost < 2 * mtbf else mtbf
    run_t = interval_steps * step_s + save_cost

    def waste(t: float) -> float:
        return save_cost / t + (t + save_cost) / (2 * mtbf)

    run_waste, opt_waste = waste(run_t), waste(max(daly, save_cost))
    return Interval(
        save_cost_s=save_cost,
        mtbf_s=mtbf,
        step_s=step_s,
        run_interval_steps=interval_steps,
        young_s=young,
        daly_s=daly,
        optimal_steps=max(1, round(daly / step_s)),
        run_waste=run_waste,
        optimal_waste=opt_waste,
        cost_s=max(0.0, run_waste - opt_waste) * wall,
    )
