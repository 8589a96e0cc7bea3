"""The supervisor's end of the heartbeat channel: one PULL socket and a table of ranks.

`HeartbeatServer` binds the socket, verifies each message (size, HMAC, schema, job; never
unpickles), drops and counts bad ones, and hands good ones on. It drains the socket on a short
timer (every 10 ms) instead of waking on its file descriptor: with thousands of ranks at 1 Hz
that is one event-loop wake-up per batch rather than one per message, and a beat waits at
most a few milliseconds against intervals of a second.

`AttemptTable` turns one attempt's messages into rank states for `decisions.judge_ranks` and
into the few notes worth an event (hello, first step, checkpoint complete, resumed, error, done).
A node's relay's `summary` moves the states of all of its ranks at once; a check then looks at
each relayed node once and at single ranks only where a node may hold a finding
(`supervisor.watch.relays`), so its cost grows with nodes, not ranks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from contracts import messages
from supervisor.policy import decisions
from supervisor.policy.decisions import Finding, Limits, RankState
from supervisor.settings.config import AUTO, HeartbeatConfig
from supervisor.watch import relays
from supervisor.watch.relays import RelayState

# Messages queued per connection (each rank has its own): a rank sends a few a second, so 100
# is seconds of slack, and a flooding peer can make us hold at most 100 frames of
# MAX_MESSAGE_BYTES; past that ZeroMQ stops reading its socket (TCP pushes back on the sender).
RCV_HWM = 100
BATCH = 5_000  # messages handled before yielding to the event loop
DRAIN_EVERY_S = 0.01
# Under load (a drain found BUSY_BATCH or more), wait longer between drains: the wake-up and
# the loop's turn cost as much as several messages, and a relayed job of 1,000 nodes sends
# 1,000 summaries a second. Light jobs keep the short wait (their events stay prompt).
BUSY_BATCH = 8
DRAIN_BUSY_EVERY_S = 0.05


class HeartbeatServer:
    """Binds `tcp://bind:port` and serves until closed; `address` is what ranks connect to."""

    def __init__(
        self,
        key: bytes,
        job: str,
        bind: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        allow: Sequence[str] = (),
    ) -> None:
        self.key = key
        self.job = job
        self.dropped: Counter[str] = Counter()
        self.received = 0
        self._ctx = zmq.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.PULL)
        if allow:  # only these addresses may connect at all (ZeroMQ's ZAP, before any frame)
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.allow(*allow)
            self._sock.zap_domain = b"elastic-supervisor"
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        # A peer sending a bigger frame than any message can be is dropped by ZeroMQ itself.
        self._sock.setsockopt(zmq.MAXMSGSIZE, messages.MAC_LEN + messages.MAX_MESSAGE_BYTES)
        if port:
            self._sock.bind(f"tcp://{bind}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bind}")
        self.port = port
        host = advertise or ("127.0.0.1" if bind in ("0.0.0.0", "*") else bind)
        self.address = f"tcp://{host}:{port}"

    async def serve(self, handle: Callable[[dict[str, Any], float], None]) -> None:
        """Call `handle(message, monotonic_now)` for every good message, forever."""
        while True:
            n = self.drain(handle)
            await asyncio.sleep(DRAIN_BUSY_EVERY_S if n >= BUSY_BATCH else DRAIN_EVERY_S)

    def drain(self, handle: Callable[[dict[str, Any], float], None]) -> int:
        """Handle up to BATCH waiting messages without blocking; return how many."""
        n = 0
        recv = self._sock.recv  # one frame per message (see messages.encode)
        key, job = self.key, self.job
        now = time.monotonic()  # one clock read per batch: they arrived within milliseconds
        while n < BATCH:
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                message = messages.decode(key, frame, job)
            except messages.BadMessage as exc:
                self.dropped[exc.reason] += 1
                continue
            self.received += 1
            handle(message, now)
        return n

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def node_addresses(nodes: Sequence[str]) -> list[str]:
    """Every address the job's nodes (and this host's loopback) may connect from."""
    found = {"127.0.0.1", "::1"}
    for node in nodes:
        try:
            infos = socket.getaddrinfo(node, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError):
            continue  # preflight refused a node that does not resolve; this one vanished since
        found.update(str(info[4][0]) for info in infos)
    return sorted(found)


@dataclass
class Note:
    """Something an attempt's messages revealed that is worth one event."""

    event: str
    fields: dict[str, Any]


DERIVE_EVERY_S = 0.5  # how often the "auto" limits are derived again from their samples
SAVES_KEPT = 20


@dataclass
class Learner:
    """An attempt's "auto" limits: the samples they are learned from (what its ranks' messages
    show: rank 0's step gaps and save times, every rank's beat gaps, all while training) and
    the limits in force (`decisions.auto_*` derive, `decisions.limit_changed` adopts). Each
    attempt learns anew: a relaunch starts at the maximum, and its first steps (slow) are not
    samples."""

    hb: HeartbeatConfig
    limits: Limits
    step_gaps: deque = field(default_factory=lambda: deque(maxlen=decisions.WINDOW))
    beat_gaps: deque = field(default_factory=lambda: deque(maxlen=decisions.WINDOW))
    saves: deque = field(default_factory=lambda: deque(maxlen=SAVES_KEPT))
    warmup_left: int = decisions.WARMUP_STEPS
    # rank (or ("relay", node): a relay's summaries are its node's beats) -> last beat, phase
    last_beat: dict[int | tuple[str, str], tuple[float, str]] = field(default_factory=dict)
    save_started: float | None = None
    next_derive: float = 0.0

    @classmethod
    def wanted(cls, hb: HeartbeatConfig | None) -> Learner | None:
        if hb is None:
            return None
        auto = AUTO in (hb.timeout_s, hb.progress.train, hb.progress.save)
        return cls(hb, decisions.fixed_limits(hb)) if auto else None

    def beat(self, rank: int | tuple[str, str], phase: str, now: float) -> None:
        last = self.last_beat.get(rank)
        self.last_beat[rank] = (now, phase)
        if last is not None and last[1] == "train" and phase == "train":
            self.beat_gaps.append(now - last[0])

    def moved(self, before: tuple[str, int, float], phase: str, now: float) -> None:
        """Rank 0's step or phase moved from `before` (phase, step, when it last moved)."""
        old, _, since = before
        if old == "train" and phase == "train":
            if self.warmup_left > 0:
                self.warmup_left -= 1
            else:
                self.step_gaps.append(now - since)
        if phase == "save" and old != "save":
            self.save_started = now
        elif old == "save" and phase != "save" and self.save_started is not None:
            self.saves.append(now - self.save_started)
            self.save_started = None

    def derive(self, now: float) -> list[Note]:
        """Every DERIVE_EVERY_S: the limits from their samples now; a note for each adopted."""
        if now < self.next_derive:
            return []
        self.next_derive = now + DERIVE_EVERY_S
        hb, cap, notes = self.hb, self.hb.auto_max, []
        if hb.progress.train == AUTO:
            got = decisions.auto_train_limit(
                self.step_gaps, self.beat_gaps, hb.interval_s, cap.train
            )
            notes += self._adopt("train", got)
        if hb.progress.save == AUTO:
            notes += self._adopt("save", decisions.auto_save_limit(self.saves, cap.save))
        if hb.timeout_s == AUTO:
            got = decisions.auto_timeout(self.beat_gaps, hb.interval_s, cap.timeout_s)
            notes += self._adopt("timeout_s", got)
        return notes

    def _adopt(self, name: str, got: tuple[float, dict] | None) -> list[Note]:
        if got is None:
            return []
        value, basis = got
        lim = self.limits
        if name == "timeout_s":
            current = lim.train_timeout_s or lim.timeout_s
        else:
            current = lim.progress[name]
        if name in lim.learned and not decisions.limit_changed(current, value):
            return []
        if name == "timeout_s":
            lim = dataclasses.replace(lim, train_timeout_s=value)
        else:
            lim = dataclasses.replace(lim, progress={**lim.progress, name: value})
        self.limits = dataclasses.replace(lim, learned=lim.learned | {name})
        said = {"limit": name, "seconds": round(value, 3), "previous_s": round(current, 3)}
        return [Note("auto_limit", {**said, **basis})]


@dataclass
class AttemptTable:
    """Rank states of one attempt, and what its ranks have said so far. With `hb` and an
    "auto" limit in it, also the limits learned from them (`limits`, `Learner`)."""

    attempt: int
    world: int
    launched_at: float
    hb: HeartbeatConfig | None = None
    learner: Learner | None = None
    ranks: dict[int, RankState] = field(default_factory=dict)
    first_step: int | None = None
    max_step: int | None = None
    resume_step: int | None = None
    resume_source: str | None = None  # memory | durable, when the ranks say (a memory tier)
    restart_seconds: float | None = None
    done_ranks: set[int] = field(default_factory=set)
    ckpt_complete: int | None = None
    mem_steps: dict[int, int] = field(default_factory=dict)  # rank -> newest memory copy said
    errors: dict[int, str] = field(default_factory=dict)
    stale: int = 0
    # Per-node relays by node name; the ranks they speak for; every other rank (judged one by
    # one); ranks with a pid by host (a check looks at this host's only).
    relays: dict[str, RelayState] = field(default_factory=dict)
    relayed: dict[int, RelayState] = field(default_factory=dict)
    direct: dict[int, RankState] = field(default_factory=dict)
    by_host: dict[str, dict[int, RankState]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.learner is None:
            self.learner = Learner.wanted(self.hb)

    def judge(
        self, now: float, hb: HeartbeatConfig, waiting: bool = False, limits: Limits | None = None
    ) -> Finding | None:
        """`decisions.judge_ranks` over this attempt's ranks: relayed ones node by node first."""
        if not self.relays:
            return decisions.judge_ranks(
                self.ranks, self.world, now, self.launched_at, hb, waiting, limits
            )
        lim = limits if limits is not None else decisions.fixed_limits(hb)
        found, silent = relays.suspects(self.relays.values(), now, lim, waiting)
        ranks = self.direct
        if found:
            ranks = {**ranks, **{st.rank: st for st in found}}
        finding = decisions.judge_ranks(
            ranks, self.world, now, self.launched_at, hb, waiting, limits, known=self.ranks
        )
        return relays.silent_relay(finding, silent) if finding is not None else None

    def exited(self, st: RankState, now: float) -> None:
        """`st`'s process is gone (the launcher or a pid check says so)."""
        st.exited, st.exited_at = True, now
        rs = self.relayed.get(st.rank)
        if rs is not None:
            rs.exited = True

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

    def update(self, msg: dict[str, Any], now: float) -> list[Note]:
        """Fold one verified message into the table; return the notes it produced."""
        if msg["kind"] == "summary":
            self._summary(msg, now)
            notes: list[Note] = []
        else:
            notes = self._update(msg, now)
        learner = self.learner
        if learner is not None and msg["attempt"] == self.attempt and msg["rank"] in self.ranks:
            st = self.ranks[msg["rank"]]
            if msg["kind"] == "beat":
                learner.beat(st.rank, st.phase, now)
            elif msg["kind"] == "summary":
                phases = msg["phases"]
                learner.beat(("relay", msg["node"]), phases if phases.__class__ is str else "", now)
            notes += learner.derive(now)
        return notes

    def _summary(self, msg: dict[str, Any], now: float) -> None:
        """Fold a relay's summary: its node's ranks seen; their steps (and phases) where they
        moved. While only steps move, two C-speed passes over the node's ranks."""
        if msg["attempt"] != self.attempt or msg["world"] != self.world:
            self.stale += 1
            return
        node, coded = msg["node"], msg["ranks"]
        rs = self.relays.get(node)
        if rs is None or rs.coded != coded:
            first, last = coded[0][0], coded[-1][0] + coded[-1][1] - 1
            if first < 0 or last >= self.world:
                self.stale += 1
                return
            rs = self._relay(node, msg["rank"], coded, now)
        rs.rank, rs.last_seen = msg["rank"], now
        late = msg["late"]
        rs.late = {r: now - age for r, age in late} if late else {}
        steps_coded, phases = msg["steps"], msg["phases"]
        if steps_coded == rs.steps_coded and phases == rs.phases_coded:
            return
        steps = messages.expand(steps_coded)
        if phases.__class__ is str and phases == rs.phases_coded:
            # Only steps moved (a node training): each rank's step and when it moved. Most often
            # every rank moved past the newest step of the last summary: no pass per rank then.
            old = rs.steps_coded
            if old and max(v for v, _ in old) < min(v for v, _ in steps_coded):
                rs.moved = [now] * len(steps)
            else:
                rs.moved = [
                    now if a != b else t for a, b, t in zip(rs.steps, steps, rs.moved, strict=True)
                ]
            rs.steps, rs.steps_coded = steps, steps_coded
            if phases != "done" and not rs.dirty:
                rs.oldest = {phases: min(rs.moved)}
            return
        # Phases moved (rare: start, saves, the end): every rank's state now.
        rs.sync()
        names = [phases] * len(steps) if phases.__class__ is str else messages.expand(phases)
        learner = self.learner
        for st, phase, step in zip(rs.states, names, steps, strict=True):
            if phase != st.phase or step != st.step:
                if st.rank == 0:
                    if learner is not None:
                        self._move(st, phase, step, now)
                        continue
                st.phase, st.step, st.last_progress = phase, step, now
        rs.steps, rs.steps_coded, rs.phases_coded = steps, steps_coded, phases
        rs.moved = [st.last_progress for st in rs.states]
        rs.dirty = True

    def _relay(self, node: str, rank: int, coded: list[list[int]], now: float) -> RelayState:
        """A relay first heard from, or one that speaks for other ranks now: its states."""
        ranks = messages.expand_ranks(coded)
        states = []
        for r in ranks:
            st = self.ranks.get(r)
            if st is None:
                st = self.ranks[r] = RankState(rank=r, last_seen=now, last_progress=now)
            self.direct.pop(r, None)
            states.append(st)
        rs = RelayState(node, rank, coded, ranks, states, now)
        for r in ranks:
            self.relayed[r] = rs
        self.relays[node] = rs
        return rs

    def _update(self, msg: dict[str, Any], now: float) -> list[Note]:
        """Fold one verified message into the table; return the notes it produced."""
        if msg["attempt"] != self.attempt:
            self.stale += 1  # a straggler of an earlier attempt
            return []
        rank = msg["rank"]
        if not 0 <= rank < self.world or msg["world"] != self.world:
            self.stale += 1
            return []
        kind = msg["kind"]
        st = self.ranks.get(rank)
        notes: list[Note] = []
        if st is None:
            st = self.state(rank, now)
        else:
            rs = self.relayed.get(rank)
            if rs is not None:
                rs.dirty = True  # its step or phase may move here, not in a summary
        st.last_seen = now
        if kind == "beat":
            self._move(st, msg["phase"], msg["step"], now)
        elif kind == "step":
            step = msg["step"]
            self._move(st, st.phase, step, now)
            if self.first_step is None:
                self.first_step = step
                notes.append(Note("first_step", {"rank": rank, "step": step, "t": msg["t"]}))
            if self.max_step is None or step > self.max_step:
                self.max_step = step
        elif kind == "phase":
            old = st.phase
            self._move(st, msg["phase"], msg["step"], now)
            if rank == 0 and old != msg["phase"]:
                notes.append(Note("phase", {"phase": msg["phase"], "step": msg["step"]}))
        elif kind == "hello":
            self.by_host.get(st.host, {}).pop(rank, None)
            st.host, st.pid = msg["host"], msg["pid"]
            self.by_host.setdefault(st.host, {})[rank] = st
            self._move(st, msg["phase"], st.step, now)
            notes.append(
                Note(
                    "rank_hello",
                    {"rank": rank, "host": st.host, "pid": st.pid, "phase": msg["phase"]},
                )
            )
        elif kind == "ckpt":
            if msg["state"] == "complete" and (
                self.ckpt_complete is None or msg["step"] > self.ckpt_complete
            ):
                self.ckpt_complete = msg["step"]
                notes.append(Note("ckpt_complete", {"step": msg["step"], "rank": rank}))
            elif msg["state"] == "memory" and msg["step"] > self.mem_steps.get(rank, -1):
                self.mem_steps[rank] = msg["step"]
        elif kind == "resumed":
            if self.resume_step is None:
                self.resume_step = msg["step"]
                self.resume_source = msg.get("source")
                self.restart_seconds = msg["restart_seconds"]
                said = {
                    "step": msg["step"],
                    "restart_seconds": msg["restart_seconds"],
                    "rank": rank,
                }
                if self.resume_source is not None:
                    said["source"] = self.resume_source
                if "why" in msg:
                    said["why"] = msg["why"]
                notes.append(Note("resumed", said))
        elif kind == "error":
            self.errors[rank] = msg["message"]
            notes.append(Note("rank_error", {"rank": rank, "message": msg["message"]}))
        elif kind == "done":
            self._move(st, "done", msg["step"], now)
            first = not self.done_ranks
            self.done_ranks.add(rank)
            if first:
                notes.append(Note("rank_done", {"rank": rank, "step": msg["step"]}))
        return notes

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
