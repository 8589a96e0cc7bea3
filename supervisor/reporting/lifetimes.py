"""The supervisor lifetimes of one run dir, told apart.

A run dir may hold several supervisors' work: a job continued (`run --resume`), or a second `run`
on the same dir after the first was killed. Each begins with its own `start` event, counts its
own restarts against its own budget, and ends with its own `supervisor_exit` (none when it was
killed). Attempt numbers go on across them. Every reader splits the events here (pure: events
and records in, spans and rows out), so no reader lays one lifetime's failures, restarts or
nodes on another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from supervisor.reporting.load import RunData, StepRecord

FAILED = ("failure", "bad_input", "diverged")  # attempt_end outcomes (policy.exits.FAILED)
# The events by which an attempt trained: its own launch (cold or prepared ranks become its
# ranks) or a standby told to go. A standby never told, and a set of prepared ranks, did not.
RAN = ("launch", "standby_go")


@dataclass(frozen=True)
class Span:
    """One lifetime's events: `events[first:stop]` (`first` is its `start`, or 0 for what came
    before any start)."""

    number: int  # 1, 2, ... in the order they ran
    first: int
    stop: int


def spans(events: list[dict]) -> list[Span]:
    """The run dir's lifetimes, oldest first; events before the first `start` (a run dir that
    lost its head) belong to the first. One span for a run dir with no `start` at all."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"] or [0]
    starts[0] = 0
    bounds = [*starts, len(events)]
    return [Span(n + 1, a, b) for n, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]


def attempt_lifetimes(events: list[dict], found: list[Span]) -> dict[int, int]:
    """attempt -> the number of the lifetime that ran it (where its number first appears)."""
    out: dict[int, int] = {}
    for s in found:
        for e in events[s.first : s.stop]:
            a = e.get("attempt")
            if isinstance(a, int) and not isinstance(a, bool):
                out.setdefault(a, s.number)
    return out


def ran(events: list[dict]) -> set[int]:
    """The attempts that trained: launched as themselves, or a standby told to go (never a
    standby left waiting, nor prepared ranks that became no attempt)."""
    return {
        e["attempt"] for e in events if e.get("event") in RAN and isinstance(e.get("attempt"), int)
    }


def restrict(data: RunData, span: Span, prior_step: int | None) -> RunData:
    """The run as one lifetime saw it: its events and its attempts' records; `prior_step`, the
    newest step earlier lifetimes reached, so that steps done again are not counted new."""
    events = data.events[span.first : span.stop]
    mine = {a for a, n in attempt_lifetimes(data.events, spans(data.events)).items()
            if n == span.number}  # fmt: skip
    records = [r for r in data.records if r.attempt in mine]
    return dataclasses.replace(data, events=events, records=records, prior_step=prior_step)


def newest_step(records: list[StepRecord]) -> int | None:
    return max((r.step for r in records), default=None)


@dataclass
class Stop:
    """A graceful stop the user asked for (SIGINT, SIGTERM or SIGHUP to the supervisor): the
    lifetime ended with exit 5, its ranks having saved where they were."""

    lifetime: int
    attempt: int | None
    at_s: float  # the signal's time on the run's timeline
    signal: str  # SIGINT | SIGTERM | SIGHUP ("" when no signal event was kept)
    step: int | None  # the newest step the stopped attempt reached
    saved: int | None  # the newest durable checkpoint that attempt completed

    @property
    def line(self) -> str:
        """`stopped by SIGINT at step 150 (checkpoint 150)` for people."""
        by = f" by {self.signal}" if self.signal else ""
        at = f" at step {self.step}" if self.step is not None else ""
        saved = f" (checkpoint {self.saved})" if self.saved is not None else " (no checkpoint)"
        return f"stopped{by}{at}{saved}"


@dataclass
class Lifetime:
    """One supervisor's part of the run, as the readers show it."""

    number: int
    job: str | None  # the job id it ran (the same for a continued job)
    at_s: float  # its start on the run's timeline (seconds since the first start)
    started_ts: float | None  # wall clock of its start
    wall_s: float  # its start to its exit (or its last sign of life)
    end: str | None  # supervisor_exit's code name; None: no final event
    reason: str | None
    killed: bool  # no final event, and a later lifetime began: it was killed
    attempts: list[int]  # the attempts that trained in it, in order
    resumed_from: int | None  # where its first attempt resumed (None: from scratch or unknown)
    resumed_source: str | None
    final_step: int | None
    restarts: int
    max_restarts: int | None
    failures: int
    continued: bool  # a `continued` event: started to go on with the job (run --resume)
    changes: list[str] = field(default_factory=list)  # settings changed when it continued
    stop: Stop | None = None
    lost: int | None = None  # steps an earlier lifetime reached beyond this one's resume
    productive_s: float = 0.0

    @property
    def state(self) -> str:
        """`DONE`, `INTERRUPTED`, ..., `killed (no final event)` or `in progress`."""
        if self.end is not None:
            return self.end
        return "killed (no final event)" if self.killed else "in progress"

    @property
    def budget(self) -> str:
        """`1 of 4 restarts` (its own budget: each lifetime starts with `max_restarts`)."""
        most = "?" if self.max_restarts is None else str(self.max_restarts)
        return f"{self.restarts} of {most} restart{'' if self.max_restarts == 1 else 's'}"

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


def lifetimes(data: RunData, t0: float, productive: dict[int, float]) -> list[Lifetime]:
    """Each lifetime of the run dir (`productive`: attempt -> seconds of new steps)."""
    events = data.events
    found = spans(events)
    where = attempt_lifetimes(events, found)
    out: list[Lifetime] = []
    best: int | None = None  # the newest step of the lifetimes before
    for s in found:
        mine = events[s.first : s.stop]
        start = next((e for e in mine if e.get("event") == "start"), {})
        end = _last(mine, "supervisor_exit")
        attempts = sorted(a for a in ran(mine) if where.get(a) == s.number)
        records = [r for r in data.records if where.get(r.attempt) == s.number]
        stamps = [_ts(e) for e in mine if "ts" in e] + [r.t for r in records]
        began = _ts(start) if start else min(stamps, default=t0)
        ended = _ts(end) if end else max(stamps, default=began)
        resumed = _own_resume(mine, attempts)
        done = _last(mine, "done")
        final = done.get("step") if done and isinstance(done.get("step"), int) else None
        reached = newest_step(records)
        final = max((x for x in (final, reached) if x is not None), default=None)
        cont = next((e for e in mine if e.get("event") == "continued"), None)
        resumed_from = resumed.get("step") if resumed else None
        life = Lifetime(
            number=s.number,
            job=start.get("job") if isinstance(start.get("job"), str) else None,
            at_s=began - t0,
            started_ts=_ts(start) if start else None,
            wall_s=max(0.0, ended - began),
            end=str(end["code_name"]) if end and end.get("code_name") else None,
            reason=str(end["reason"]) if end and end.get("reason") else None,
            killed=end is None and s.number < len(found),
            attempts=attempts,
            resumed_from=resumed_from if isinstance(resumed_from, int) else None,
            resumed_source=_str(resumed.get("source")) if resumed else None,
            final_step=final,
            restarts=sum(1 for e in mine if e.get("event") == "relaunch"),
            max_restarts=_int(start.get("max_restarts")),
            failures=sum(
                1 for e in mine if e.get("event") == "attempt_end" and e.get("outcome") in FAILED
            ),  # fmt: skip
            continued=cont is not None,
            changes=change_lines(cont),
            stop=stop_of(mine, s.number, t0),
            productive_s=sum(productive.get(a, 0.0) for a in attempts),
        )
        if best is not None and life.resumed_from is not None:
            life.lost = max(0, best - life.resumed_from)
        if reached is not None:
            best = reached if best is None else max(best, reached)
        out.append(life)
    return out


def _own_resume(events: list[dict], attempts: list[int]) -> dict | None:
    """The `resumed` event of the lifetime's first attempt that got going (None: it started
    from scratch, or none got going): where this supervisor took the job up."""
    for a in attempts:
        going = [e for e in events if e.get("attempt") == a
                 and e.get("event") in ("resumed", "first_step")]  # fmt: skip
        if going:
            return next((e for e in going if e.get("event") == "resumed"), None)
    return None


def stop_of(events: list[dict], lifetime: int, t0: float) -> Stop | None:
    """The lifetime's graceful stop, from its `give_up` INTERRUPTED (None without one)."""
    give_up = _last(events, "give_up")
    if give_up is None or give_up.get("code_name") != "INTERRUPTED":
        return None
    signal = next((e for e in events if e.get("event") == "signal"), None)
    attempt = _int(give_up.get("attempt"))
    end = next((e for e in events if e.get("event") == "attempt_end"
                and e.get("attempt") == attempt), None)  # fmt: skip
    return Stop(
        lifetime=lifetime,
        attempt=attempt if end is not None else None,
        at_s=_ts(signal or give_up) - t0,
        signal=str(signal.get("signal") or "") if signal else "",
        step=_int(end.get("max_step")) if end else None,
        saved=_int(end.get("ckpt_complete")) if end else None,
    )


def change_lines(continued: dict | None) -> list[str]:
    """`worker.train_iters: 1500 -> 500 (allowed: ...)` per setting a continuation changed."""
    if continued is None or not isinstance(continued.get("changes"), list):
        return []
    out = []
    for c in continued["changes"]:
        if not isinstance(c, dict):
            continue
        line = f"{c.get('key')}: {_shown(c.get('old'))} -> {_shown(c.get('new'))}"
        if c.get("breaks"):
            line += f" (allowed; {c['breaks']})"
        out.append(line)
    return out


def _shown(v: Any) -> str:
    if v is None:
        return "(unset)"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _last(ev: list[dict], name: str) -> dict | None:
    return next((e for e in reversed(ev) if e.get("event") == name), None)


def _ts(e: dict | None) -> float:
    v = (e or {}).get("ts")
    return float(v) if isinstance(v, (int, float)) else 0.0


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None
