"""Per-node relays on the supervisor's side: what one relay's summaries say of its node's ranks,
and which of those ranks a check must look at (worker.relay sends the summaries).

The ranks' states stay `liveness.RankState`s, one per rank, judged by `liveness.judge_ranks`
exactly as beats would have them; what changes is the work per check. Without relays every
check scans every rank. With them, a check looks at each node once (`suspects`): its summaries'
arrival, the ranks its relay said were late, whether one of its ranks' processes ended, and the
oldest progress per phase among its ranks (kept when a summary moves them). Only a node where
one of those could be a finding is scanned rank by rank, and only its ranks that are findings
are handed on: the cost of a check grows with nodes, and the finding still names single ranks.

A rank's last-seen time under a relay: the arrival of the relay's last summary, unless that
summary said the rank was late (then its own last message, by the relay's clock), whichever is
newer than what the rank's own forwarded messages say. A relay that goes silent leaves all of its
node's ranks unseen since its last summary: they are lost together, and the finding names the
node and every one of its ranks not done (`silent_relay`), also one whose own message came
straight after the relay's last summary and so passes its deadline a moment later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from supervisor.policy.limits import Limits
from supervisor.policy.liveness import Finding, RankState

# "auto" relays ranks when the job is big enough for the supervisor to feel every rank's beats
# (and a node has more than one rank): below it, beats straight from every rank cost little and
# name a stopped local rank 0 alone rather than its node.
RELAY_AUTO_MIN_WORLD = 1024


def relay_wanted(setting: bool | Literal["auto"], world: int, ranks_per_node: int) -> bool:
    """Whether the ranks of an attempt relay through one rank per node ([heartbeat] relay)."""
    if ranks_per_node <= 1:
        return False  # nothing to aggregate: a node's only rank would relay itself
    if setting == "auto":
        return world >= RELAY_AUTO_MIN_WORLD
    return bool(setting)


@dataclass(slots=True, eq=False)
class RelayState:
    """One node's relay as its summaries tell it (monotonic times, the supervisor's clock).

    While only steps move (the common case: a node training), a summary updates two lists, each
    rank's step and the time it last moved, in one C-speed pass each; the ranks' `RankState`s
    take them when someone looks (`sync`: a check that looks at the node, a finding). Rank 0
    says every step itself (worker.beat): its state follows its own messages only."""

    node: str
    rank: int  # the relay's own rank
    coded: list[list[int]]  # its ranks as its summary codes them ([first, count] runs)
    ranks: list[int]
    states: list[RankState]  # the same ranks' states (the attempt table's own objects)
    last_seen: float  # when its last summary arrived
    late: dict[int, float] = field(default_factory=dict)  # rank -> last seen, if said late
    steps_coded: list | None = None  # as its last summary said them
    phases_coded: str | list | None = None
    steps: list[int] = field(default_factory=list)  # per rank, in `ranks` order
    moved: list[float] = field(default_factory=list)  # when each one's step last moved
    # phase -> the oldest last_progress among its ranks in that phase (done ones left out):
    # kept when a summary moves ranks; `dirty` when something else did (recomputed at the next
    # check). Last-progress times only grow, so a stale value is early, never late.
    oldest: dict[str, float] = field(default_factory=dict)
    dirty: bool = True
    exited: bool = False  # some rank's process is known to be gone
    index: dict[int, int] = field(init=False)  # rank -> its place in `ranks`

    def __post_init__(self) -> None:
        self.index = {r: i for i, r in enumerate(self.ranks)}
        if not self.steps:
            self.steps = [st.step for st in self.states]
            self.moved = [st.last_progress for st in self.states]

    def seen(self, st: RankState) -> float:
        return max(st.last_seen, self.late.get(st.rank, self.last_seen))

    def sync(self, i: int | None = None) -> None:
        """The summaries' steps into the rank states (all, or the `i`th), where newer."""
        for k in range(len(self.states)) if i is None else (i,):
            st, moved = self.states[k], self.moved[k]
            if moved > st.last_progress and st.rank != 0:
                st.step, st.last_progress = self.steps[k], moved

    def steps_moved(self, steps: list[int], steps_coded: list, phase: str, now: float) -> None:
        """A summary where only steps moved (a node training, all its ranks in `phase`): each
        rank's step and when it moved. Most often every rank moved past the newest step of the
        last summary: no pass per rank then."""
        old = self.steps_coded
        if old and max(v for v, _ in old) < min(v for v, _ in steps_coded):
            self.moved = [now] * len(steps)
        else:
            self.moved = [
                now if a != b else t for a, b, t in zip(self.steps, steps, self.moved, strict=True)
            ]
        self.steps, self.steps_coded = steps, steps_coded
        if phase != "done" and not self.dirty:
            self.oldest = {phase: min(self.moved)}

    def refresh(self) -> None:
        if not self.dirty:
            return
        self.sync()
        oldest: dict[str, float] = {}
        for st in self.states:
            phase = st.phase
            if phase == "done":
                continue
            o = oldest.get(phase)
            if o is None or st.last_progress < o:
                oldest[phase] = st.last_progress
        self.oldest, self.dirty = oldest, False


def suspects(
    relays: Iterable[RelayState], now: float, lim: Limits, waiting: bool = False
) -> tuple[list[RankState], dict[str, RelayState]]:
    """Pure (but for each relay's own cache): the relayed ranks a check must judge, each with its
    last-seen time as the relay says it (copies: the table's states are not written), and the
    relays gone silent (past the liveness deadline), by node. Every other relayed rank is one
    that `liveness.judge_ranks` would find healthy."""
    liveness = now - lim.timeout_s
    train_liveness = now - lim.train_timeout_s if lim.train_timeout_s else liveness
    latest = max(liveness, train_liveness)  # a summary older than this: some rank may be lost
    p = lim.progress
    by_phase = {**p, "standby": float("inf") if waiting else p["load"]}
    train = p["train"]
    out: list[RankState] = []
    silent: dict[str, RelayState] = {}
    soonest = now - min(by_phase.values(), default=train)  # no progress older: nothing stalled
    for relay in relays:
        if relay.dirty:
            relay.refresh()
        whole = relay.exited or relay.last_seen < latest
        if not whole and relay.oldest and min(relay.oldest.values()) < soonest:
            for phase, oldest in relay.oldest.items():
                if now - oldest > by_phase.get(phase, train):
                    whole = True
                    break
        if whole:
            relay.sync()
            candidates: Iterable[RankState] = relay.states
        elif relay.late:
            candidates = []
            for r in relay.late:
                i = relay.index.get(r)
                if i is not None:
                    relay.sync(i)
                    candidates.append(relay.states[i])
        else:
            continue
        for st in candidates:
            if st.phase == "done":
                continue
            seen = relay.seen(st)
            if (
                st.exited
                or seen < (train_liveness if st.phase == "train" else liveness)
                or now - st.last_progress > by_phase.get(st.phase, train)
            ):
                out.append(st if seen == st.last_seen else dataclasses.replace(st, last_seen=seen))
        if relay.last_seen < latest:
            silent[relay.node] = relay
    return out, silent


def silent_relay(finding: Finding, silent: dict[str, RelayState]) -> Finding:
    """A `hang` whose ranks include a silent relay's node: said as that node's failure (the node
    in the finding, the relay in its reason, and every one of its ranks not done among the
    finding's ranks). Other findings are returned as they are.

    Every rank of the node is named, not only those already past their deadline: a rank's own
    messages that reached the supervisor straight after the relay's last summary (the relay's
    own step or phase, a member's forwarded one) leave it seen a little later than its node's
    other ranks, but with the relay silent none of them is heard from any more."""
    if finding.kind != "hang" or not silent:
        return finding
    named = set(finding.ranks)
    involved = [relay for relay in silent.values() if named.intersection(relay.ranks)]
    if not involved:
        return finding
    for r in involved:
        named.update(st.rank for st in r.states if st.phase != "done")
    relay = min(involved, key=lambda r: r.last_seen)
    nodes = ", ".join(sorted(r.node for r in involved))
    why = (
        f"{finding.reason}; the relay of node {relay.node} (rank {relay.rank}) sent no summary "
        f"for its {len(relay.ranks)} ranks"
        + (f" (silent relays: {nodes})" if len(involved) > 1 else "")
    )
    ranks = tuple(sorted(named))
    return dataclasses.replace(finding, ranks=ranks, reason=why, node=relay.node)
