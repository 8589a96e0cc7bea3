"""What the training loop does after a bad step (worker.guard_step judged it, never applied):
name it and the ranks behind it, then skip its batch or roll back to the newest checkpoint; or,
after `guard.GIVE_UP_AFTER` bad steps in a row, stop the run with one clear message."""

from __future__ import annotations

import math

from worker import guard
from worker.build import Training
from worker.errors import Diverged
from worker.guard import Baseline
from worker.guard_step import Stepped, every_rank


def recover(t: Training, step: int, done: Stepped, tokens_seen: int) -> tuple[int, int]:
    """Collective, after a bad step (never applied): name it, then skip its batch or roll back.
    Returns the step the run goes on after and its tokens."""
    g, info = t.guard, t.info
    verdict, ranks = guard.blame(
        done.verdict,
        g.cfg,
        g.baseline,
        *every_rank(done.loss, done.local_grad, info.rank, info.world, t.device),
    )
    if info.rank == 0:
        value = verdict.value if math.isfinite(verdict.value) else str(verdict.value)
        t.beacon.numeric_fault(step, ranks, verdict.kind, value, verdict.what, g.cfg.action)
    t.say(
        f"GUARD: step {step} not applied: {verdict.kind} ({verdict.what} {verdict.value:.6g}) "
        f"on rank(s) {','.join(map(str, ranks))}",
        flush=True,
    )
    stop = guard.give_up(g.bad_in_a_row, step, verdict)
    if stop is not None:  # every rank judged alike: every rank stops here
        raise Diverged(stop)
    if g.cfg.action == "rollback":
        before = g.ranges
        resumed = t.ckpt.rollback(step)
        if resumed is not None:
            first, last = guard.rollback_range(resumed.step, step, before, g.cfg.skip_batches)
            g.skip((first, last))
            g.baseline = Baseline.from_record((resumed.data or {}).get("guard"))
            if info.rank == 0:
                t.beacon.rollback(step, resumed.step, f"{first}-{last}")
            t.say(
                f"GUARD: rolled back to step {resumed.step} ({resumed.source}); data positions "
                f"{first}-{last} skipped",
                flush=True,
            )
            return resumed.step, resumed.tokens_seen
        t.say("GUARD: no checkpoint to roll back to: skipping the batch instead", flush=True)
    first, last = guard.skip_range(step, g.ranges)
    g.skip((first, last))
    t.say(f"GUARD: data position {first} skipped; step {step} redone", flush=True)
    return step - 1, tokens_seen
