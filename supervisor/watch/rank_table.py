"""The rank table of one attempt: its ranks' states, built from their messages, for
`liveness.judge_ranks`, and the few facts worth an event (hello, first step, checkpoint complete,
resumed, error, done).

A node's relay's `summary` moves the states of all of its ranks at once; a check then looks at
each relayed node once and at single ranks only where a node may hold a finding
(`supervisor.watch.relays`), so its cost grows with nodes, not ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contracts import messages
from supervisor.policy import error_lines
from supervisor.policy.limits import Limits, fixed_limits
from supervisor.policy.liveness import Finding, RankState, judge_ranks
from supervisor.settings.config import HeartbeatConfig
from supervisor.watch import relays
from supervisor.watch.auto_limits import Learner
from supervisor.watch.relays import RelayState
from supervisor.watch.table_events import GUARD_EVENTS, EventToEmit, guard_event


@dataclass
class AttemptTable:
    """Rank states of one attempt, and what its ranks have said so far. With `heartbeat` and an
    "auto" limit in it, also the limits learned from them (`limits`, `Learner`)."""

    attempt: int
    world: int
    launched_at: float
    heartbeat: HeartbeatConfig | None = None
    learner: Learner | None = None
    hello_s: float | None = None  # ranks told to start (prepared): their hello deadline
    ranks: dict[int, RankState] = field(default_factory=dict)
    first_step: int | None = None
    max_step: int | None = None
    resume_step: int | None = None
    resume_source: str | None = None  # memory | durable, when the ranks say (a memory tier)
    done_ranks: set[int] = field(default_factory=set)
    ckpt_complete: int | None = None
    mem_steps: dict[int, int] = field(default_factory=dict)  # rank -> newest memory copy said
    errors: dict[int, str] = field(default_factory=dict)
    # Each `cause` a rank's error said (diverged: its guard gave up; usage: it refused its
    # input), with the first line that said it.
    causes: dict[str, str] = field(default_factory=dict)
    stale: int = 0
    # Per-node relays by node name; the ranks they speak for; every other rank (judged one by
    # one); ranks with a pid by host (a check looks at this host's only).
    relays: dict[str, RelayState] = field(default_factory=dict)
    relayed: dict[int, RelayState] = field(default_factory=dict)
    direct: dict[int, RankState] = field(default_factory=dict)
    by_host: dict[str, dict[int, RankState]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.learner is None:
            self.learner = Learner.wanted(self.heartbeat)

    def judge(
        self,
        now: float,
        heartbeat: HeartbeatConfig,
        waiting: bool = False,
        limits: Limits | None = None,
    ) -> Finding | None:
        """`judge_ranks` over this attempt's ranks: relayed ones node by node first."""
        if not self.relays:
            return judge_ranks(
                self.ranks, self.world, now, self.launched_at, heartbeat, waiting, limits,
                hello_s=self.hello_s,
            )  # fmt: skip
        lim = limits if limits is not None else fixed_limits(heartbeat)
        found, silent = relays.suspects(self.relays.values(), now, lim, waiting)
        ranks = self.direct
        if found:
            ranks = {**ranks, **{st.rank: st for st in found}}
        finding = judge_ranks(
            ranks, self.world, now, self.launched_at, heartbeat, waiting, limits,
            known=self.ranks, hello_s=self.hello_s,
        )  # fmt: skip
        return relays.silent_relay(finding, silent) if finding is not None else None

    def exited(self, st: RankState, now: float) -> None:
        """`st`'s process is gone (the launcher or a pid check says so)."""
        st.exited, st.exited_at = True, now
        relay = self.relayed.get(st.rank)
        if relay is not None:
            relay.exited = True

    def state(self, rank: int, now: float) -> RankState:
        """`rank`'s state, a new one (seen now) if it was never heard from."""
        st = self.ranks.get(rank)
        if st is None:
            st = self.ranks[rank] = RankState(rank, now, now)
            if rank not in self.relayed:
                self.direct[rank] = st
        return st

    @property
    def judged(self) -> int:
        """What one check looks at: every rank, or with relays each node and each other rank."""
        return len(self.direct) + len(self.relays) if self.relays else self.world

    def on_host(self, host: str) -> list[RankState]:
        """The ranks that said they run on `host` (with their pid)."""
        return list(self.by_host.get(host, {}).values())

    @property
    def limits(self) -> Limits | None:
        """The limits in force when some are learned ("auto"); None: the config's."""
        return self.learner.limits if self.learner is not None else None

    def update(self, msg: dict[str, Any], now: float) -> list[EventToEmit]:
        """Fold one verified message into the table; return the events it produced."""
        if msg["kind"] == "summary":
            self._summary(msg, now)
            events: list[EventToEmit] = []
        else:
            events = self._update(msg, now)
        learner = self.learner
        if learner is not None and msg["attempt"] == self.attempt and msg["rank"] in self.ranks:
            st = self.ranks[msg["rank"]]
            if msg["kind"] == "beat":
                learner.beat(st.rank, st.phase, now)
            elif msg["kind"] == "summary":
                phases = msg["phases"]
                learner.beat(("relay", msg["node"]), phases if phases.__class__ is str else "", now)
            events += learner.derive(now)
        return events

    def _summary(self, msg: dict[str, Any], now: float) -> None:
        """Fold a relay's summary: its node's ranks seen; their steps (and phases) where they
        moved. While only steps move, two C-speed passes over the node's ranks."""
        if msg["attempt"] != self.attempt or msg["world"] != self.world:
            self.stale += 1
            return
        node, coded = msg["node"], msg["ranks"]
        relay = self.relays.get(node)
        if relay is None or relay.coded != coded:
            first, last = coded[0][0], coded[-1][0] + coded[-1][1] - 1
            if first < 0 or last >= self.world:
                self.stale += 1
                return
            relay = self._add_relay(node, msg["rank"], coded, now)
        relay.rank, relay.last_seen = msg["rank"], now
        late = msg["late"]
        relay.late = {r: now - age for r, age in late} if late else {}
        steps_coded, phases = msg["steps"], msg["phases"]
        if steps_coded == relay.steps_coded and phases == relay.phases_coded:
            return
        steps = messages.expand(steps_coded)
        if phases.__class__ is str and phases == relay.phases_coded:
            relay.steps_moved(steps, steps_coded, phases, now)
            return
        # Phases moved (rare: start, saves, the end): every rank's state now.
        relay.sync()
        names = [phases] * len(steps) if phases.__class__ is str else messages.expand(phases)
        learner = self.learner
        for st, phase, step in zip(relay.states, names, steps, strict=True):
            if phase != st.phase or step != st.step:
                if st.rank == 0:
                    if learner is not None:
                        self._move(st, phase, step, now)
                        continue
                st.phase, st.step, st.last_progress = phase, step, now
        relay.steps, relay.steps_coded, relay.phases_coded = steps, steps_coded, phases
        relay.moved = [st.last_progress for st in relay.states]
        relay.dirty = True

    def _add_relay(self, node: str, rank: int, coded: list[list[int]], now: float) -> RelayState:
        """A relay first heard from, or one that speaks for other ranks now: its states."""
        ranks = messages.expand_ranks(coded)
        states = []
        for r in ranks:
            st = self.ranks.get(r)
            if st is None:
                st = self.ranks[r] = RankState(rank=r, last_seen=now, last_progress=now)
            self.direct.pop(r, None)
            states.append(st)
        relay = RelayState(node, rank, coded, ranks, states, now)
        for r in ranks:
            self.relayed[r] = relay
        self.relays[node] = relay
        return relay

    def _update(self, msg: dict[str, Any], now: float) -> list[EventToEmit]:
        """Fold one verified message into the table; return the events it produced."""
        if msg["attempt"] != self.attempt:
            self.stale += 1  # a straggler of an earlier attempt
            return []
        rank = msg["rank"]
        if not 0 <= rank < self.world or msg["world"] != self.world:
            self.stale += 1
            return []
        kind = msg["kind"]
        st = self.ranks.get(rank)
        events: list[EventToEmit] = []
        if st is None:
            st = self.state(rank, now)
        else:
            relay = self.relayed.get(rank)
            if relay is not None:
                relay.dirty = True  # its step or phase may move here, not in a summary
        st.last_seen = now
        if kind == "beat":
            self._move(st, msg["phase"], msg["step"], now)
        elif kind == "step":
            step = msg["step"]
            self._move(st, st.phase, step, now)
            if self.first_step is None:
                self.first_step = step
                events.append(
                    EventToEmit("first_step", {"rank": rank, "step": step, "t": msg["t"]})
                )
            if self.max_step is None or step > self.max_step:
                self.max_step = step
        elif kind == "phase":
            old = st.phase
            self._move(st, msg["phase"], msg["step"], now)
            if rank == 0 and old != msg["phase"]:
                events.append(EventToEmit("phase", {"phase": msg["phase"], "step": msg["step"]}))
        elif kind == "hello":
            self.by_host.get(st.host, {}).pop(rank, None)
            st.host, st.pid = msg["host"], msg["pid"]
            self.by_host.setdefault(st.host, {})[rank] = st
            self._move(st, msg["phase"], st.step, now)
            events.append(
                EventToEmit(
                    "rank_hello",
                    {"rank": rank, "host": st.host, "pid": st.pid, "phase": msg["phase"]},
                )
            )
        elif kind == "ckpt":
            if msg["state"] == "complete" and (
                self.ckpt_complete is None or msg["step"] > self.ckpt_complete
            ):
                self.ckpt_complete = msg["step"]
                events.append(EventToEmit("ckpt_complete", {"step": msg["step"], "rank": rank}))
            elif msg["state"] == "memory" and msg["step"] > self.mem_steps.get(rank, -1):
                self.mem_steps[rank] = msg["step"]
        elif kind == "resumed":
            if self.resume_step is None:
                self.resume_step = msg["step"]
                self.resume_source = msg.get("source")
                said = {
                    "step": msg["step"],
                    "restart_seconds": msg["restart_seconds"],
                    "rank": rank,
                }
                if self.resume_source is not None:
                    said["source"] = self.resume_source
                if "why" in msg:
                    said["why"] = msg["why"]
                events.append(EventToEmit("resumed", said))
        elif kind in GUARD_EVENTS:
            if rank == 0:  # the job's one word on it
                events.append(guard_event(msg))
        elif kind == "error":
            self.errors[rank] = msg["message"]
            st.said_error_at = now
            if "cause" in msg:
                self.causes.setdefault(msg["cause"], msg["message"])
            # A survivor's word that a peer is gone is the other rank's failure, not its own.
            said = "rank_peer_lost" if error_lines.peer_lost(msg["message"]) else "rank_error"
            events.append(EventToEmit(said, {"rank": rank, "message": msg["message"]}))
        elif kind == "done":
            self._move(st, "done", msg["step"], now)
            first = not self.done_ranks
            self.done_ranks.add(rank)
            if first:
                events.append(EventToEmit("rank_done", {"rank": rank, "step": msg["step"]}))
        return events

    def _move(self, st: RankState, phase: str, step: int, now: float) -> None:
        if phase != st.phase or step != st.step:
            if st.rank == 0 and self.learner is not None:
                self.learner.moved((st.phase, st.step, st.last_progress), phase, now)
            st.phase, st.step, st.last_progress = phase, step, now

    @property
    def stepped(self) -> bool:
        return self.first_step is not None

    @property
    def mem_complete(self) -> int | None:
        """The newest memory-tier copy every rank said it holds (None: not every rank said one).
        The ranks copy the same steps in step, so each holds this step or a newer one."""
        if len(self.mem_steps) < self.world:
            return None
        return min(self.mem_steps.values())

    @property
    def saved_step(self) -> int | None:
        """The newest checkpoint this attempt completed: durable, or in memory on every rank."""
        done = [s for s in (self.ckpt_complete, self.mem_complete) if s is not None]
        return max(done) if done else None

    def effective_resume_step(self) -> int | None:
        """Where this attempt started: its `resumed` step, 0 if it stepped without one."""
        if self.resume_step is not None:
            return self.resume_step
        return 0 if self.stepped else None

    def local_pids(self, host: str) -> list[int]:
        return [st.pid for st in self.on_host(host) if st.pid]
