"""Whether a rank is alive and moving: the rules one check applies to the ranks' last messages.

A liveness deadline (no message at all) and a progress limit per phase (beating, but its step not
moving) are judged apart, so that a hung process and a stalled one are told apart. Every input is
passed in (the ranks' states, `now`, the limits in force): each rule is unit-tested with plain
values, and the watch code (supervisor.watch) gathers the facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from supervisor.policy.limits import Limits, fixed_limits
from supervisor.settings.config import HeartbeatConfig


@dataclass(slots=True)
class RankState:
    """What the supervisor knows of one rank in the current attempt (monotonic times)."""

    rank: int
    last_seen: float
    last_progress: float
    host: str = ""
    pid: int = 0  # from its hello; 0: it has said none
    phase: str = "init"
    step: int = -1
    # The rank's process is gone (seen by the local launcher or a pid check on this host).
    exited: bool = False
    exited_at: float = 0.0
    # When it said its error (a rank's last word before it exits); 0: it has not.
    said_error_at: float = 0.0


# A rank that said its error and then nothing for this long has ended: on another host, where
# no pid is watched and a launcher may keep the others alive for its own kill delay (srun:
# Slurm's KillWait, 30 s by default, while a rank stuck in a collective ignores SIGTERM).
ERROR_GONE_S = 1.0


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
    heartbeat: HeartbeatConfig,
    waiting: bool = False,
    limits: Limits | None = None,
    known: Mapping[int, RankState] | None = None,
    hello_s: float | None = None,
) -> Finding | None:
    """A rank gone before `done` first (its process seen ended, or silent ERROR_GONE_S since it
    said its error), then liveness (no message for `timeout_s`), then
    progress (the phase's timeout), then ranks that never said hello (the init timeout, or
    `hello_s` where the ranks were told to start rather than launched: prepared ranks).

    `limits`: the limits in force (learned ones included); by default the config's, every
    "auto" at its maximum. `waiting`: the attempt is a standby; its ranks may stay in phase
    `standby` for good. Once told to go, one still in `standby` has the load timeout to move
    on. `known`: every rank heard from, when `ranks` holds only those to judge (relayed ranks are
    judged node by node first: supervisor.watch.relays); by default `ranks`."""
    lim = limits if limits is not None else fixed_limits(heartbeat)
    gone: list[tuple[RankState, float]] = []  # each with when it ended
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
            gone.append((st, st.exited_at))
        elif st.said_error_at and now - st.last_seen >= ERROR_GONE_S:
            gone.append((st, st.last_seen + ERROR_GONE_S))
        elif st.last_seen < (train_liveness if st.phase == "train" else liveness_deadline):
            lost.append(st)
        else:
            limit = by_phase.get(st.phase, train)
            if now - st.last_progress > limit:
                stalled.append((st, limit))
    missing: list[int] = []
    heard = ranks if known is None else known
    hello = p["init"] if hello_s is None else hello_s
    if len(heard) < world and now - launched_at > hello:
        missing = [r for r in range(world) if r not in heard]
    if gone:
        first, ended = min(gone, key=lambda p: p[1])
        said = ", silent since its error" if not first.exited else ""
        said += "" if first.pid else ", never having said hello"
        return Finding(
            kind="rank_exit",
            ranks=tuple(s.rank for s, _ in gone),
            reason=f"rank {first.rank} ended in phase {first.phase!r} before the job was "
            f"done{said}",
            phase=first.phase,
            step=first.step,
            deadline=ended,
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
        still = f"for {now - worst.last_progress:.1f} s"
        if worst.phase == "init":  # it never left `init` (a hello gives a rank its pid)
            said = "said hello, then" if worst.pid else "beats but no hello,"
            reason = f"{said} no phase or step {still} (init timeout {_secs(limit)} s)"
        else:
            reason = (
                f"step {worst.step} has not moved in phase {worst.phase!r} {still} "
                f"(timeout {_secs(limit)} s{auto})"
            )
        return Finding(
            kind="no_progress",
            ranks=tuple(s.rank for s, _ in stalled),
            reason=reason,
            phase=worst.phase,
            step=worst.step,
            deadline=worst.last_progress + limit,
        )
    if missing:
        return Finding(
            kind="no_progress",
            ranks=tuple(missing),
            reason=(
                f"no hello within the init timeout ({hello:g} s)"
                if hello_s is None
                else f"no hello within {hello:g} s of the word to become these ranks"
            ),
            phase="init",
            step=-1,
            deadline=launched_at + hello,
        )
    return None


def _secs(x: float) -> str:
    return f"{round(x, 2):g}"


def judge_period(world: int, check_s: float) -> float:
    """How often to judge: every `check_s`, stretched for large jobs so that the scan (one
    pass over every rank) stays near 50,000 rank-checks a second: 0.2 s at 10,000 ranks."""
    return max(check_s, world / 50_000)
