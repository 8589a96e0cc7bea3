"""Firings whose `fault` event waits for their ranks, so that a `fault` event always means the
action was carried out (faults.engine keeps them):

- a `nan` or `spike`, sent ahead of its step and held by the rank for it (faults.schedule),
  until the rank says what came of it (`fault_ack`: applied at that step, or too late);
- any command to a rank whose control socket was not connected yet, until the retries end
  (faults.delivery).

Each resolves into one `fault` event for the ranks it reached and one `fault_undelivered` for
those it did not, with why (`events`). A nan or spike whose attempt ended before any of its
ranks reached its step is given back to the schedule instead: the next attempt gets it.
Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Key = tuple[int, int, int]  # (attempt, fault index, n): one firing


@dataclass(eq=False)
class Pending:
    """One firing in flight: its `fault` event's fields as at the send (for every target
    rank), the step a nan or spike is for (None: another action, done once sent), and where
    each rank stands."""

    key: Key
    fields: dict[str, Any]
    step: int | None
    sent_mono: float
    waiting: set[int]
    reached: dict[int, int | None] = field(default_factory=dict)  # rank -> the step it acted at
    failed: dict[int, str] = field(default_factory=dict)  # rank -> why not

    @property
    def done(self) -> bool:
        return not self.waiting

    def answer(self, rank: int, reached: int | None = None, why: str | None = None) -> None:
        self.waiting.discard(rank)
        if why is None:
            self.reached[rank] = reached
        else:
            self.failed[rank] = why


class InFlight:
    """The firings in flight; each call returns those it resolved."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def hold(self, p: Pending) -> list[Pending]:
        if p.done:
            return [p]
        self.pending.append(p)
        return []

    def acked(self, attempt: int, rank: int, msg: dict[str, Any]) -> list[Pending]:
        """A rank's `fault_ack` (contracts.messages)."""
        step = msg["step"]
        for p in self.pending:
            if p.key[:2] == (attempt, msg["fault"]) and p.step == step and rank in p.waiting:
                if msg["applied"]:
                    p.answer(rank, reached=step)
                else:
                    late = f"it came when the rank was at step {msg['at']}, past {step}"
                    p.answer(rank, why=late)
                return self._take_done()
        return []

    def retried(self, key: Key, sent: list[int], failed: dict[int, str]) -> list[Pending] | None:
        """Delivery's retries for a firing ended (None: not one of these). A nan or spike sent
        now still waits for its rank's word; any other command is done."""
        p = next((p for p in self.pending if p.key == key), None)
        if p is None:
            return None
        for rank in sent:
            if p.step is None:
                p.answer(rank)
        for rank, why in failed.items():
            p.answer(rank, why=why)
        return self._take_done()

    def attempt_over(self, attempt: int) -> tuple[list[Pending], list[Pending]]:
        """The attempts before `attempt` are over (their messages are in): (the nan and spike
        points none of whose ranks reached their step, to give back; the firings resolved, their
        ranks still waiting laid to the attempt's end)."""
        back, resolved = [], []
        for p in [p for p in self.pending if p.key[0] < attempt]:
            self.pending.remove(p)
            if p.step is not None and not p.reached and not p.failed:
                back.append(p)
                continue
            for rank in list(p.waiting):
                p.answer(rank, why=f"attempt {p.key[0]} ended before the rank acted on it")
            resolved.append(p)
        return back, resolved

    def close(self) -> list[Pending]:
        """The job is over: whatever waits was never carried out."""
        for p in self.pending:
            for rank in list(p.waiting):
                p.answer(rank, why="the job ended before the rank acted on it")
        out, self.pending = self.pending, []
        return out

    def _take_done(self) -> list[Pending]:
        done = [p for p in self.pending if p.done]
        self.pending = [p for p in self.pending if not p.done]
        return done


def events(p: Pending) -> list[tuple[str, dict[str, Any]]]:
    """A resolved firing's events: `fault` for the ranks it reached (a nan's or spike's
    `steps` the step each acted at, `sent_step` and `sent_mono` when its command went), then
    `fault_undelivered` for the others. The `fault` event has no `total`: the engine counts."""
    out: list[tuple[str, dict[str, Any]]] = []
    f = p.fields
    if p.reached:
        at = [f["ranks"].index(r) for r in sorted(p.reached)]
        fault = {**f, **{k: [f[k][i] for i in at] for k in ("ranks", "pids", "hosts", "via")}}
        fault.pop("retrying", None)
        if p.step is not None:
            fault["steps"] = [p.reached[r] for r in sorted(p.reached)]
            fault["phases"] = ["train"] * len(at)
            fault["sent_step"], fault["step"] = f["step"], p.step
            fault["sent_mono"] = round(p.sent_mono, 6)
        else:
            fault["steps"] = [f["steps"][i] for i in at]
            fault["phases"] = [f["phases"][i] for i in at]
        out.append(("fault", fault))
    if p.failed:
        attempt, index, n = p.key
        undelivered = {"attempt": attempt, "fault": index, "name": f["name"], "n": n}
        undelivered |= {"action": f["action"], "ranks": sorted(p.failed)}
        undelivered["errors"] = [f"rank {r}: {why}" for r, why in sorted(p.failed.items())]
        if p.step is not None:
            undelivered["step"] = p.step
        out.append(("fault_undelivered", undelivered))
    return out
