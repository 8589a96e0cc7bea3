"""Stragglers: which ranks' steps are slow against the job's, from their compute seconds alone.

A slow rank makes every other rank wait for it in the step's collectives: its own compute (the
step's seconds less its wait in collectives, worker.step_clock) is long, theirs is not. So each
observation (one a step where every rank's steps reach the supervisor, else one a heartbeat
interval: supervisor.watch.step_times) scores every rank's compute over the median of all
ranks' computes; a rank whose median score over its last `window` observations is above
`threshold` is a straggler. Medians on both sides keep one noisy step, or one noisy rank, from
moving anything. One finding per episode: a rank flagged is flagged again only after its
window's median fell back to the threshold or below. A node's ranks flagged at once are one
finding, named with their node. A node where the job's own processes are starting (its warm
standby, its prepared ranks, a fork template: imports that take the node's cores) is not
judged meanwhile: its ranks' observations of those steps are not scored (`StartingNodes`).

Pure: fed observations, returns findings; the supervisor acts (supervisor.run.stragglers).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

# A median compute below this is taken as this: a rank of a job whose steps are all wait (or
# nearly nothing) is not scored against a denominator of noise.
MIN_MEDIAN_S = 1e-3
MIN_RANKS = 2  # fewer ranks have no median to be slow against


@dataclass(frozen=True)
class StragglerFinding:
    """The ranks of one node found slow at one observation: the `straggler` event's facts."""

    ranks: tuple[int, ...]
    node: str
    score: float  # the highest of the ranks' window medians
    step: int
    window: int  # observations judged: one a step where every rank's steps reach the supervisor
    since_step: int  # the step of the window's first observation

    def fields(self) -> dict[str, object]:
        return {
            "ranks": list(self.ranks),
            "node": self.node,
            "score": round(self.score, 3),
            "step": self.step,
            "window": self.window,
            "since_step": self.since_step,
        }


def scores(computes: Mapping[int, float]) -> dict[int, float]:
    """Each rank's compute over the median compute of all of them (1.0: a typical rank)."""
    if len(computes) < MIN_RANKS:
        return {}
    median = max(statistics.median(computes.values()), MIN_MEDIAN_S)
    return {rank: c / median for rank, c in computes.items()}


def window_score(history: deque[float] | list[float], window: int) -> float | None:
    """A rank's score over its last `window` observations (their median); None before it has
    that many."""
    if len(history) < window:
        return None
    return statistics.median(list(history)[-window:])


@dataclass
class StragglerScore:
    """Every rank's recent scores and which are flagged now (IO-free: the caller feeds it)."""

    threshold: float
    window: int
    history: dict[int, deque[float]] = field(default_factory=dict)
    flagged: set[int] = field(default_factory=set)
    observations: int = 0
    steps: deque[int] = field(default_factory=deque)  # the steps of the last `window` ones
    judged: dict[int, deque[int]] = field(default_factory=dict)  # a rank's scored ones' steps

    def observe(
        self,
        step: int,
        computes: Mapping[int, float],
        node_of: Callable[[int], str],
        busy: Collection[str] = (),
    ) -> list[StragglerFinding]:
        """One observation (each rank's latest step compute, at about `step`): the findings it
        makes, one per node with a rank newly above the threshold. The ranks of `busy` nodes
        (the job's own processes starting there) count in the median, but are not scored."""
        now = scores(computes)
        if not now:
            return []
        self.observations += 1
        self.steps.append(step)
        while len(self.steps) > self.window:
            self.steps.popleft()
        new: dict[str, list[tuple[int, float]]] = {}
        for rank, score in now.items():
            if busy and node_of(rank) in busy:
                continue
            hist = self.history.get(rank)
            if hist is None:
                hist = self.history[rank] = deque(maxlen=self.window)
                self.judged[rank] = deque(maxlen=self.window)
            hist.append(score)
            self.judged[rank].append(step)
            over = window_score(hist, self.window)
            if over is None:
                continue
            if rank in self.flagged:
                if over <= self.threshold:
                    self.flagged.discard(rank)  # recovered: the next episode is a new finding
            elif over > self.threshold:
                self.flagged.add(rank)
                new.setdefault(node_of(rank), []).append((rank, over))
        return [
            StragglerFinding(
                tuple(r for r, _ in found),
                node,
                max(s for _, s in found),
                step,
                self.window,
                min(self.judged[r][0] for r, _ in found),
            )
            for node, found in sorted(new.items())
        ]


@dataclass
class StartingNodes:
    """Which steps each node's ranks took while the job's own processes started there (a
    standby, prepared ranks, a fork template), from what the caller sees at each check: a node
    starting now marks every step said so far, and goes on marking them for `settle_s` after
    its start ended (a step computed during the start may be said a beat later)."""

    settle_s: float
    upto: dict[str, int] = field(default_factory=dict)  # node -> newest step marked
    ended: dict[str, float] = field(default_factory=dict)  # node -> when its start was over

    def note(self, starting: Collection[str], newest_step: int, now: float) -> None:
        """At a check: the nodes starting now, the newest step any rank has said."""
        for node in starting:
            self.ended.pop(node, None)
            self.upto[node] = max(self.upto.get(node, newest_step), newest_step)
        for node in list(self.upto):
            if node in starting:
                continue
            since = self.ended.setdefault(node, now)
            if now - since <= self.settle_s:
                self.upto[node] = max(self.upto[node], newest_step)

    def busy_at(self, step: int) -> frozenset[str]:
        """The nodes whose ranks are not judged at an observation of `step`."""
        return frozenset(node for node, upto in self.upto.items() if step <= upto)


def replace_now(found_step: int, ckpt_complete: int | None, last_step: int | None) -> bool:
    """A pending replacement is due once a durable checkpoint newer than its finding is
    complete, unless that checkpoint is the job's last step: the job is over, and a relaunch
    would only load it to stop."""
    if ckpt_complete is None or ckpt_complete <= found_step:
        return False
    return last_step is None or ckpt_complete < last_step


@dataclass(frozen=True)
class Response:
    """What the supervisor does about a finding: `replace` (at the next durable checkpoint, a
    graceful stop and a relaunch without the node), else only the event; `said`: in words."""

    replace: bool
    said: str


def respond(
    action: str,
    spares: int,
    shrink: bool,
    active: int,
    min_nodes: int,
    pending: bool,
    restarts_left: int = 1,
    checkpoints: bool = True,
) -> Response:
    """`[stragglers] action` against what the job has: a spare takes the slow node's place;
    without one, shrink (when allowed and enough nodes are left) excludes it; else, while a
    replacement is already pending, with no restart left (the relaunch is one), or in a job that
    makes no durable checkpoint (the replacement waits for the next one), the finding is
    reported only."""
    if action != "replace":
        return Response(False, "reported")
    if not checkpoints:
        return Response(
            False, "reported only: the job makes no durable checkpoints (worker.save_interval 0)"
        )
    if pending:
        return Response(False, "reported: a replacement is already pending")
    if restarts_left < 1:
        return Response(False, "reported only: no restart left for the relaunch (max_restarts)")
    if spares > 0:
        return Response(True, "a spare takes its node's place after the next durable checkpoint")
    if shrink and active - 1 >= min_nodes:
        return Response(True, "its node is excluded (shrink) after the next durable checkpoint")
    return Response(False, "reported only: no spare, and shrink is off or too few nodes are left")
