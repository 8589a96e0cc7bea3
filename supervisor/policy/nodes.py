"""The job's nodes: which run the ranks, which wait as spares, which are out, and which node a
failure is laid on. Pure functions over facts; the job acts on what they return.

Ranks are placed in blocks (`ranks_per_node` consecutive ranks per node, in the order of the
active list: what `mpiexec -ppn`, PALS `--ppn` and `srun --ntasks-per-node` do), so a rank's
node follows from its number. A spare takes an excluded node's place in that order, so every
rank keeps its number and the world and mesh stay the same.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from supervisor.policy import error_lines


@dataclass(frozen=True)
class NodePool:
    """The job's nodes now: `active` run the ranks (in rank order), `spares` wait, `excluded`
    are out for the rest of the job."""

    active: tuple[str, ...]
    spares: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()

    @classmethod
    def split(cls, nodes: Sequence[str], spares: int) -> NodePool:
        """The resolved list's last `spares` nodes start idle (PBS_NODEFILE / Slurm order)."""
        cut = len(nodes) - spares
        return cls(tuple(nodes[:cut]), tuple(nodes[cut:]))

    def node_of(self, rank: int, ranks_per_node: int) -> str:
        return self.active[rank // ranks_per_node]

    def as_dict(self) -> dict[str, list[str]]:
        """The pool as events say it: a node out is never listed active too (a job that stops
        for want of nodes keeps them in `active`, as it launches no more)."""
        return {
            "active": [n for n in self.active if n not in self.excluded],
            "spares": list(self.spares),
            "excluded": list(self.excluded),
        }


# --- which node a failure is laid on ---------------------------------------------------------
@dataclass(frozen=True)
class FailureFacts:
    """What an attempt knew of its failure when it ended (ranks, first first)."""

    kind: str  # exit | rank_exit | hang | no_progress
    finding_ranks: tuple[int, ...] = ()  # the ranks the watch named
    finding_node: str | None = None  # the node the watch named (its relay went silent)
    error_ranks: tuple[int, ...] = ()  # ranks that reported an error before any rank was gone
    first_exited: tuple[int, ...] = ()  # the ranks seen gone first (together), on this host
    launcher_named: tuple[int, ...] = ()  # the launcher's first bad termination
    injected: tuple[int, ...] = ()  # the ranks a disruptive injected fault hit in the attempt
    stalled_outside_collectives: tuple[int, ...] = ()  # of a no_progress, from their stacks


@dataclass(frozen=True)
class Attribution:
    node: str | None
    ranks: tuple[int, ...]  # the ranks the failure is laid on
    why: str  # which fact, or why no node

    def as_dict(self) -> dict[str, object]:
        return {"node": self.node, "ranks": list(self.ranks), "why": self.why}


def attribute(facts: FailureFacts, active: Sequence[str], ranks_per_node: int) -> Attribution:
    """The node a failure is laid on, from the most telling fact there is: an injected fault's
    target; a node whose heartbeat relay went silent; the ranks that raised while every rank
    still ran (errors after a rank is gone are its peers noticing: "connection reset"; the same
    error on every node is the job's, not a node's); the ranks whose beats stopped; of ranks
    making no progress, those not waiting inside a collective (the others wait for them); the
    first rank whose process ended (seen to the millisecond on this host), else the launcher's
    report of its first bad termination.

    A failure whose ranks span several nodes, or that takes down every active node, says
    nothing about any one node (a single-node job never excludes its node this way)."""
    if facts.finding_node is not None and not facts.injected:
        return Attribution(facts.finding_node, facts.finding_ranks, "its relay went silent")
    stalled = facts.stalled_outside_collectives or facts.finding_ranks
    candidates: list[tuple[tuple[int, ...], str]] = [
        (facts.injected, "the injected fault's target"),
        (facts.error_ranks, "the ranks that reported an error"),
        (facts.finding_ranks if facts.kind == "hang" else (), "the ranks whose beats stopped"),
        (stalled if facts.kind == "no_progress" else (), "the ranks that stopped stepping"),
        (facts.first_exited, "the first rank whose process ended"),
        (facts.launcher_named, "the launcher's first bad termination"),
    ]
    for ranks, fact in candidates:
        ranks = tuple(r for r in ranks if 0 <= r < len(active) * ranks_per_node)
        if not ranks:
            continue
        nodes = sorted({active[r // ranks_per_node] for r in ranks})
        if len(nodes) > 1:
            return Attribution(None, ranks, f"{fact} span nodes {', '.join(nodes)}")
        if len(active) == 1:
            return Attribution(None, ranks, f"{fact}: on the job's only active node")
        return Attribution(nodes[0], ranks, fact)
    return Attribution(None, (), "no fact names a rank")


def own_errors(
    errors: Mapping[int, str], error_at: Mapping[int, float], first_gone: float
) -> tuple[int, ...]:
    """The ranks whose error is a fact about themselves: reported before any rank was seen
    gone, and not a peer's loss in its words (under load the supervisor may read a survivor's
    "connection reset" before the pidfd of the rank that died first)."""
    return tuple(
        r
        for r, at in error_at.items()
        if at < first_gone and not error_lines.peer_lost(errors.get(r, ""))
    )


# Hydra's report of the first process that ended badly: "=   PID 17890 RUNNING AT n1".
_HYDRA_BAD = re.compile(r"PID (\d+) RUNNING AT (\S+)")


def launcher_named_ranks(output_tail: Sequence[str], pids: Mapping[int, int]) -> tuple[int, ...]:
    """The rank the launcher names as its first bad termination (MPICH Hydra's `BAD
    TERMINATION` block) in the attempt's last output lines; `pids`: rank -> pid."""
    by_pid = {pid: rank for rank, pid in pids.items() if pid}
    for line in output_tail:
        m = _HYDRA_BAD.search(line)
        if m and int(m.group(1)) in by_pid:
            return (by_pid[int(m.group(1))],)
    return ()


def first_exited(exits: Mapping[int, float]) -> tuple[int, ...]:
    """The ranks seen gone first (`exits`: rank -> when seen gone); all of them when several
    were seen at the same moment (one check saw them together)."""
    if not exits:
        return ()
    first = min(exits.values())
    return tuple(sorted(r for r, t in exits.items() if t == first))


# Where a stack says a rank is waiting for the others (a collective or a barrier).
_COLLECTIVE = re.compile(r"torch/distributed/|mpi4py|barrier|all_gather|all_reduce|broadcast")


def outside_collectives(stack_lines: Mapping[int, str]) -> tuple[int, ...]:
    """Of ranks making no progress, those whose innermost frame is not a collective: the others
    are waiting for them. `stack_lines`: rank -> where its main thread is (one line)."""
    return tuple(sorted(r for r, where in stack_lines.items() if not _COLLECTIVE.search(where)))


# --- what an exclusion does to the pool -----------------------------------------------------------
@dataclass(frozen=True)
class NodeChange:
    """The pool after excluding nodes: `swap` (spares took their places: same world), `shrink`
    (fewer nodes: a smaller world), or `stop` (the job cannot go on: `reason`)."""

    action: Literal["swap", "shrink", "stop"]
    pool: NodePool
    swaps: tuple[tuple[str, str], ...] = ()  # (out, in)
    reason: str = ""


def excluded_now(counts: Mapping[str, int], exclude_after: int, pool: NodePool) -> list[str]:
    """The active nodes whose attributed failures reached `exclude_after` (0: never)."""
    if exclude_after <= 0:
        return []
    return [n for n in pool.active if counts.get(n, 0) >= exclude_after]


def recheck_before_relaunch(
    down: Collection[str], pool: NodePool, silent_node: str | None = None
) -> bool:
    """Whether the nodes must be checked again before the next launch: a node known lost (a
    `node_loss` took it) is still in the pool, or (`silent_node`) the failure is laid on a node
    of another host whose ranks all went silent (a hang, no progress): a host that died looks
    just so from here. A lost node's check then fails and it is out at once, a spare in its
    place, without waiting for `exclude_after`."""
    if silent_node is not None and silent_node in pool.active:
        return True
    return any(n in pool.active or n in pool.spares for n in down)


def exclude(pool: NodePool, out: Sequence[str], shrink: bool, min_nodes: int) -> NodeChange:
    """Take `out` (active nodes, or spares) out of the job: each active place goes to the first
    spare left; with none, `shrink` goes on with the nodes that remain, down to `min_nodes`;
    else the job stops."""
    active = list(pool.active)
    spares = [n for n in pool.spares if n not in out]  # a spare that failed its check is out too
    swaps: list[tuple[str, str]] = []
    left: list[str] = []
    for node in out:
        if node not in active:
            continue
        if spares:
            spare = spares.pop(0)
            active[active.index(node)] = spare
            swaps.append((node, spare))
        else:
            left.append(node)
    excluded = (*pool.excluded, *(n for n in out if n in pool.active or n in pool.spares))
    if not left:
        return NodeChange("swap", NodePool(tuple(active), tuple(spares), excluded), tuple(swaps))
    names = ", ".join(left)
    remaining = [n for n in active if n not in left]
    # a stop's pool: the nodes still good, none both excluded and active or spare
    stopped = NodePool(tuple(remaining), tuple(spares), excluded)
    if not shrink:
        return NodeChange(
            "stop",
            stopped,
            tuple(swaps),
            f"{names} excluded and no spare node left; set [restart] shrink = true to go on "
            "with fewer nodes, or give the job spare nodes ([launch] spares)",
        )
    if len(remaining) < min_nodes:
        return NodeChange(
            "stop",
            stopped,
            tuple(swaps),
            f"{names} excluded, no spare node left, and {len(remaining)} node(s) remain, "
            f"below [restart] min_nodes = {min_nodes}; add nodes or lower min_nodes",
        )
    return NodeChange("shrink", NodePool(tuple(remaining), (), excluded), tuple(swaps))
