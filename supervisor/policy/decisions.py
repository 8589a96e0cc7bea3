"""What the supervisor decides, as pure functions over observed facts.

Nothing here touches a process, a socket or the clock: every input (exit codes, the ranks' last
beats and steps, `now`, the attempts so far) is passed in, so each rule is unit-tested with plain
values. `attempt.py` and `job.py` gather the facts and act on the answers.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from contracts.exit_codes import ExitCode
from supervisor.settings.config import AUTO, HeartbeatConfig, RestartConfig


# --- ranks: liveness and progress ----------------------------------------------------------------
@dataclass(slots=True)
class RankState:
    """What the supervisor knows of one rank in the current attempt (monotonic times)."""

    rank: int
    last_seen: float
    last_progress: float
    host: str = ""
    pid: int = 0
    phase: str = "init"
    step: int = -1
    # The rank's process is gone (seen by the local launcher or a pid check on this host).
    exited: bool = False
    exited_at: float = 0.0


@dataclass(frozen=True)
class Finding:
    """A rank judged unhealthy: `rank_exit` (its process ended before `done`), `hang` (liveness
    lost) or `no_progress` (beating, not moving)."""

    kind: Literal["rank_exit", "hang", "no_progress"]
    ranks: tuple[int, ...]
    reason: str
    phase: str
    step: int
    # When the worst rank's deadline passed: detection latency is measured from here.
    deadline: float
    # The node it is laid on, when the facts say so (a node's relay gone silent:
    # supervisor.watch.relays).
    node: str | None = None


def judge_ranks(
    ranks: Mapping[int, RankState],
    world: int,
    now: float,
    launched_at: float,
    hb: HeartbeatConfig,
    waiting: bool = False,
    limits: Limits | None = None,
    known: Mapping[int, RankState] | None = None,
) -> Finding | None:
    """A rank gone before `done` first, then liveness (no message for `timeout_s`), then
    progress (the phase's timeout), then ranks that never said hello (the init timeout).

    `limits`: the limits in force (learned ones included); by default the config's, every
    "auto" at its maximum. `waiting`: the attempt is a standby; its ranks may stay in phase
    `standby` for good. Once told to go, one still in `standby` has the load timeout to move
    on. `known`: every rank heard from, when `ranks` holds only those to judge (relayed ranks are
    judged node by node first: supervisor.watch.relays); by default `ranks`."""
    lim = limits if limits is not None else fixed_limits(hb)
    gone: list[RankState] = []
    lost: list[RankState] = []
    stalled: list[tuple[RankState, float]] = []
    liveness_deadline = now - lim.timeout_s
    train_liveness = now - lim.train_timeout_s if lim.train_timeout_s else liveness_deadline
    p = lim.progress
    standby = float("inf") if waiting else p["load"]
    by_phase = {**p, "standby": standby}
    train = p["train"]
    # One pass over the ranks heard from: this runs every check for every rank of the job.
    for st in ranks.values():
        if st.phase == "done":
            continue
        if st.exited:
            gone.append(st)
        elif st.last_seen < (train_liveness if st.phase == "train" else liveness_deadline):
            lost.append(st)
        else:
            limit = by_phase.get(st.phase, train)
            if now - st.last_progress > limit:
                stalled.append((st, limit))
    missing: list[int] = []
    heard = ranks if known is None else known
    if len(heard) < world and now - launched_at > p["init"]:
        missing = [r for r in range(world) if r not in heard]
    if gone:
        first = min(gone, key=lambda s: s.exited_at)
        return Finding(
            kind="rank_exit",
            ranks=tuple(s.rank for s in gone),
            reason=f"rank {first.rank} ended in phase {first.phase!r} before the job was done",
            phase=first.phase,
            step=first.step,
            deadline=first.exited_at,
        )
    if lost:

        def timeout(st: RankState) -> float:
            return (
                lim.train_timeout_s
                if st.phase == "train" and lim.train_timeout_s
                else lim.timeout_s
            )

        worst = min(lost, key=lambda s: s.last_seen + timeout(s))
        t = timeout(worst)
        auto = ", auto" if worst.phase == "train" and lim.train_timeout_s else ""
        return Finding(
            kind="hang",
            ranks=tuple(s.rank for s in lost),
            reason=f"no heartbeat for {now - worst.last_seen:.1f} s (timeout {_secs(t)} s{auto})",
            phase=worst.phase,
            step=worst.step,
            deadline=worst.last_seen + t,
        )
    if stalled:
        worst, limit = min(stalled, key=lambda p: p[0].last_progress + p[1])
        auto = ", auto" if worst.phase in lim.learned else ""
        return Finding(
            kind="no_progress",
            ranks=tuple(s.rank for s, _ in stalled),
            reason=(
                f"step {worst.step} has not moved in phase {worst.phase!r} for "
                f"{now - worst.last_progress:.1f} s (timeout {_secs(limit)} s{auto})"
            ),
            phase=worst.phase,
            step=worst.step,
            deadline=worst.last_progress + limit,
        )
    if missing:
        return Finding(
            kind="no_progress",
            ranks=tuple(missing),
            reason=f"no hello within the init timeout ({p['init']:g} s)",
            phase="init",
            step=-1,
            deadline=launched_at + p["init"],
        )
    return None


def _secs(x: float) -> str:
    return f"{round(x, 2):g}"


# --- limits learned from the run ("auto") ---------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """The liveness timeout and the progress limits in force (seconds). `train_timeout_s`: the
    liveness timeout while a rank trains, once learned (other phases keep `timeout_s`: a save
    or a load may hold a rank's GIL long enough to delay its beats). `learned`: which limits
    are learned values now: `timeout_s`, `train`, `save`."""

    timeout_s: float
    progress: Mapping[str, float]
    train_timeout_s: float | None = None
    learned: frozenset[str] = frozenset()


def fixed_limits(hb: HeartbeatConfig) -> Limits:
    """The config's limits, each "auto" at its maximum: what holds until something is learned."""
    cap = hb.auto_max
    timeout = cap.timeout_s if hb.timeout_s == AUTO else hb.timeout_s
    progress = {}
    for phase in ("init", "load", "train", "save"):
        v = getattr(hb.progress, phase)
        progress[phase] = getattr(cap, phase, 0.0) if v == AUTO else v
    return Limits(float(timeout), progress)


@dataclass(frozen=True)
class AutoRule:
    """How one "auto" limit is derived: `multiple` x the recent p99 of its samples (+ slack),
    never below `floor_s` nor above the maximum; nothing before `min_samples` samples."""

    multiple: float
    floor_s: float
    min_samples: int


# Conservative on purpose: a false finding costs a relaunch. Step gaps on a loaded 2-core host
# reach 3-5x their median; p99 over the recent window already holds the spikes seen so far.
TRAIN_RULE = AutoRule(multiple=4.0, floor_s=1.5, min_samples=20)  # and >= 2 beat intervals
TIMEOUT_RULE = AutoRule(multiple=4.0, floor_s=2.0, min_samples=20)  # and >= 3 beat intervals
SAVE_RULE = AutoRule(multiple=4.0, floor_s=10.0, min_samples=2)
WARMUP_STEPS = 5  # an attempt's first step gaps are not samples (start-up: allocation, caches)
WINDOW = 200  # the recent samples a p99 is taken over


def quantile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q <= 1) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def auto_train_limit(
    step_gaps: Sequence[float], beat_gaps: Sequence[float], interval_s: float, max_s: float
) -> tuple[float, dict] | None:
    """Pure: the train progress limit learned from rank 0's recent step gaps (one step's end to
    the next, in phase train): `multiple` x their p99, plus the p99 gap between beats (the
    other ranks' step reaches us only with a beat, up to a beat late), within [floor, max_s];
    the floor is at least two beat intervals. None until there are enough samples."""
    rule = TRAIN_RULE
    if len(step_gaps) < rule.min_samples:
        return None
    p99_step = quantile(step_gaps, 0.99)
    p99_beat = quantile(beat_gaps, 0.99) if beat_gaps else interval_s
    floor = max(rule.floor_s, 2 * interval_s)
    value = min(max_s, max(floor, rule.multiple * p99_step + p99_beat))
    basis = {"p99_step_s": round(p99_step, 4), "p99_beat_gap_s": round(p99_beat, 4),
             "samples": len(step_gaps), "multiple": rule.multiple, "floor_s": floor,
             "max_s": max_s}  # fmt: skip
    return value, basis


def auto_timeout(
    beat_gaps: Sequence[float], interval_s: float, max_s: float
) -> tuple[float, dict] | None:
    """Pure: the liveness timeout while training, learned from the gaps between consecutive
    beats of each rank: `multiple` x their p99, within [floor, max_s]; the floor is at least
    three beat intervals. None until there are enough samples."""
    rule = TIMEOUT_RULE
    if len(beat_gaps) < rule.min_samples:
        return None
    p99 = quantile(beat_gaps, 0.99)
    floor = max(rule.floor_s, 3 * interval_s)
    value = min(max_s, max(floor, rule.multiple * p99))
    basis = {"p99_beat_gap_s": round(p99, 4), "samples": len(beat_gaps),
             "multiple": rule.multiple, "floor_s": floor, "max_s": max_s}  # fmt: skip
    return value, basis


def auto_save_limit(durations: Sequence[float], max_s: float) -> tuple[float, dict] | None:
    """Pure: the save progress limit learned from how long rank 0's recent saves took:
    `multiple` x the longest, within [floor, max_s]. None until enough saves were seen."""
    rule = SAVE_RULE
    if len(durations) < rule.min_samples:
        return None
    longest = max(durations)
    value = min(max_s, max(rule.floor_s, rule.multiple * longest))
    basis = {"longest_save_s": round(longest, 4), "samples": len(durations),
             "multiple": rule.multiple, "floor_s": rule.floor_s, "max_s": max_s}  # fmt: skip
    return value, basis


def limit_changed(current: float, derived: float) -> bool:
    """Whether a derived limit differs enough from the one in force to replace it (and be said
    in an event): up by 10 % (and 0.1 s), or down by 25 % (and 0.2 s). Rising follows load
    at once; falling waits for a clear change, so the limit does not flap step by step."""
    if derived > current:
        return derived - current >= max(0.1, 0.10 * current)
    return current - derived >= max(0.2, 0.25 * current)


# --- the warm standby --------------------------------------------------------------------------
def standby_ready(ranks: Mapping[int, RankState], world: int) -> bool:
    """Every rank of the standby has said it is prepared and waiting."""
    return len(ranks) == world and all(st.phase == "standby" for st in ranks.values())


def standby_unusable(
    ready: bool, alive: bool, standby_nodes: Sequence[str], bad_nodes: Sequence[str]
) -> str | None:
    """Why the next attempt cannot be the standby (it then starts cold), or None to use it."""
    if not alive:
        return "no standby running"
    if not ready:
        return "the standby was not ready"
    bad = sorted(set(standby_nodes) & set(bad_nodes))
    if bad:
        return f"the standby runs on the failed node {', '.join(bad)}"
    return None


STANDBY_GIVE_UP_AFTER = 5  # standbys lost in a row before ever being ready: stop keeping one


def standby_retry_delay(lost_in_a_row: int, schedule: Sequence[float]) -> float | None:
    """Seconds before starting another standby after `lost_in_a_row` (>= 1) were lost without
    getting ready, or None to stop keeping one (a broken environment must not loop). The
    restart schedule's delays, at least 1 s: a standby is never urgent."""
    if lost_in_a_row >= STANDBY_GIVE_UP_AFTER:
        return None
    return max(1.0, backoff_delay(lost_in_a_row - 1, schedule))


def judge_period(world: int, check_s: float) -> float:
    """How often to judge: every `check_s`, stretched for large jobs so that the scan (one
    pass over every rank) stays near 50,000 rank-checks a second: 0.2 s at 10,000 ranks."""
    return max(check_s, world / 50_000)


# --- the launcher's exit -------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """How an attempt ended. Only `failure` is worth another attempt."""

    kind: Literal["success", "stopped", "bad_input", "failure"]
    detail: str


def describe_returncode(rc: int) -> str:
    """`exit 1`, `killed by SIGKILL`, `exit 137 (SIGKILL)`: launchers report signals as 128+N."""
    if rc < 0:
        return f"killed by {_signame(-rc)}"
    if rc > 128 and _signame(rc - 128, None):
        return f"exit {rc} ({_signame(rc - 128)})"
    return f"exit {rc}"


def _signame(n: int, default: str | None = "signal") -> str | None:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"{default} {n}" if default else None


def classify_exit(returncode: int, *, done: bool, stopping: bool, stepped: bool) -> Outcome:
    """The attempt's outcome from the launcher's exit status and what the ranks said.

    - 0 and a rank said `done`: success.
    - 0 after the supervisor asked the ranks to stop: a graceful stop.
    - 2 before any step: the worker rejected its flags or inputs; relaunching cannot help.
    - anything else (a signal, a code, or 0 without `done`): a failure.
    """
    what = describe_returncode(returncode)
    if returncode == 0 and done:
        return Outcome("success", "the worker finished")
    if returncode == 0 and stopping:
        return Outcome("stopped", "the ranks stopped gracefully")
    if returncode == 2 and not stepped and not stopping:
        return Outcome("bad_input", "the worker rejected its input (exit 2)")
    if returncode == 0:
        return Outcome("failure", "exit 0 before the worker said done")
    return Outcome("failure", what)


def attempt_outcome(
    finding: Finding | None, returncode: int | None, *, done: bool, stopping: bool, stepped: bool
) -> Outcome:
    """A finding (a rank gone, a hang, no progress) makes the attempt a failure; else its exit
    status decides (None: no status was collected, as for a process killed in teardown)."""
    if finding is not None:
        return Outcome("failure", f"{finding.kind}: {finding.reason}")
    rc = -signal.SIGKILL if returncode is None else returncode
    return classify_exit(rc, done=done, stopping=stopping, stepped=stepped)


# --- across attempts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttemptRecord:
    """One finished attempt: where it resumed and how far it got (None: never got there)."""

    attempt: int
    resume_step: int | None
    max_step: int | None
    outcome: str = "failure"
    error: str | None = None  # what the ranks or the launcher said last (`error_of`)
    # The newest checkpoint it completed: durable, or a memory-tier copy every rank holds.
    saved_step: int | None = None


def made_progress(rec: AttemptRecord, min_steps: int) -> bool:
    if rec.max_step is None:
        return False
    return rec.max_step - (rec.resume_step or 0) >= min_steps


def consecutive_unproductive(history: Sequence[AttemptRecord], min_steps: int) -> int:
    """Failed attempts in a row, counted back from the last, that made no progress."""
    n = 0
    for rec in reversed(history):
        if made_progress(rec, min_steps):
            break
        n += 1
    return n


def backoff_delay(unproductive: int, schedule: Sequence[float]) -> float:
    """The schedule's entry for this many unproductive attempts in a row; the last repeats."""
    return float(schedule[min(max(unproductive, 0), len(schedule) - 1)])


def saved_progress(rec: AttemptRecord) -> bool:
    """The attempt completed a checkpoint (durable, or a memory copy every rank holds) newer
    than the one it resumed from: the next attempt resumes further on."""
    return rec.saved_step is not None and rec.saved_step > (rec.resume_step or 0)


def stuck_resume(history: Sequence[AttemptRecord], times: int) -> list[int] | None:
    """The resume steps of the last `times` attempts when each of them resumed (stepped) and
    none completed a checkpoint newer than its resume step (`saved_progress`); else None.
    Steps made and lost again are no progress: a relaunch would resume where they did."""
    last = history[-times:]
    if len(last) < times or any(r.resume_step is None or saved_progress(r) for r in last):
        return None
    return [r.resume_step for r in last if r.resume_step is not None]


def error_of(rank_errors: Mapping[int, str], tail: Sequence[str]) -> str | None:
    """One line that says what went wrong: the lowest rank's own error (its last line: a
    traceback ends with the exception), else the last line of output that reads like an error
    and is no warning (`is_warning`: the rank went on after it, so it did not end the attempt).
    Two attempts that fail alike give the same line (no pids or times in it)."""
    if rank_errors:
        message = rank_errors[min(rank_errors)].strip().splitlines()
        return message[-1][:MAX_ERROR_CHARS] if message else None
    found = None
    after_warning = False  # the indented lines below a Python warning are part of it
    for line in tail:
        raw = _RANK_PREFIX.sub("", line)
        text = raw.strip()
        if is_warning(text):
            after_warning = _PY_WARNING.match(text) is not None
            continue
        if after_warning and raw[:1].isspace():
            continue
        after_warning = False
        if _ERRORISH.search(text):
            found = text
    return found[:MAX_ERROR_CHARS] if found is not None else None


def is_warning(line: str) -> bool:
    """A line of output that is a warning, not an error: the worker's `WARNING: …` (the memory
    tier off, a checkpoint skipped or failed while training goes on), a Python warning
    (`file.py:12: UserWarning: …`) or a c10 one (`[W1203 12:00:00 socket.cpp:663] …`)."""
    return _WARNING.match(line) is not None


def early_repeat(history: Sequence[AttemptRecord], times: int = 2) -> str | None:
    """The error of the last `times` attempts if each failed before its first step with that
    same error: relaunching again would only fail the same way."""
    last = history[-times:]
    if len(last) < times or any(r.max_step is not None or r.outcome != "failure" for r in last):
        return None
    errors = {r.error for r in last}
    return last[0].error if len(errors) == 1 and last[0].error else None


def unfixable(error: str | None) -> str | None:
    """An error that no relaunch on these nodes can fix, said as the job's end: a host that
    does not resolve, a checkpoint or stage dir that is full or read-only (the worker's line)."""
    if not error:
        return None
    match = _UNRESOLVED_HOST.search(error)
    if match:
        return f"the launcher cannot start: host {match.group(1)!r} does not resolve ({error})"
    if _STORAGE_FULL.match(error):
        return error
    return None


MAX_ERROR_CHARS = 300
_RANK_PREFIX = re.compile(r"^\[\d+\]\s?")
_ERRORISH = re.compile(r"error|exception|could not|cannot|failed|denied|not found", re.I)
_PY_WARNING = re.compile(r"\S.*:\d+: \w*Warning: ")
_WARNING = re.compile(rf"warn(?:ing)?\b|\[W[\d ]|{_PY_WARNING.pattern}", re.I)
_UNRESOLVED_HOST = re.compile(r"[Cc]ould not resolve hostname ([^\s:]+)")
_STORAGE_FULL = re.compile(r"(disk full|disk quota exceeded|read-only file system): ")


def restarts_left(max_restarts: int, restarts_done: int) -> int:
    return max(0, max_restarts - restarts_done)


@dataclass(frozen=True)
class Decision:
    action: Literal["done", "relaunch", "stop"]
    exit_code: ExitCode
    reason: str
    delay_s: float = 0.0
    facts: dict = field(default_factory=dict)


def decide(
    outcome: Outcome,
    history: Sequence[AttemptRecord],
    restarts_done: int,
    cfg: RestartConfig,
    interrupted: bool = False,
) -> Decision:
    """After an attempt ended (`history` includes it): finish, relaunch, or stop, and why."""
    if outcome.kind == "success":
        return Decision("done", ExitCode.DONE, outcome.detail)
    if interrupted or outcome.kind == "stopped":
        return Decision("stop", ExitCode.INTERRUPTED, "interrupted: " + outcome.detail)
    if outcome.kind == "bad_input":
        return Decision("stop", ExitCode.USAGE, outcome.detail)
    last_error = history[-1].error if history else None
    cannot = unfixable(last_error)
    if cannot is not None:
        return Decision("stop", ExitCode.USAGE, cannot)
    repeated = early_repeat(history)
    if repeated is not None:
        return Decision(
            "stop",
            ExitCode.NO_PROGRESS,
            f"2 attempts in a row failed before their first step with: {repeated}",
            facts={"error": repeated},
        )
    steps = stuck_resume(history, cfg.max_same_resume)
    if steps is not None:
        n = cfg.max_same_resume
        if len(set(steps)) == 1:
            said = f"resumed from step {steps[0]} and completed no newer checkpoint"
        else:
            said = (
                "completed no checkpoint newer than the one each resumed from (steps "
                f"{', '.join(map(str, steps))})"
            )
        return Decision(
            "stop",
            ExitCode.NO_PROGRESS,
            f"no progress: {n} attempts in a row {said}",
            facts={"resume_step": steps[-1]},
        )
    if restarts_done >= cfg.max_restarts:
        return Decision(
            "stop",
            ExitCode.BUDGET,
            f"restart budget exhausted ({cfg.max_restarts} restarts)",
        )
    delay = backoff_delay(consecutive_unproductive(history, cfg.min_progress_steps), cfg.backoff_s)
    return Decision("relaunch", ExitCode.DONE, outcome.detail, delay_s=delay)
