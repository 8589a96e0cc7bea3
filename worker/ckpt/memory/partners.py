"""Pure decisions of partner copies: which rank holds whose memory copy, and which step a resume
takes when a rank's own copies are gone with its node.

A rank's partner is the rank at the same place on the next node (nodes in the order of their
first rank; the last node's partner is the first node): a node's loss then takes its ranks' own
copies and the copies they held for the previous node, never both copies of one rank. Two
neighbouring nodes lost take both, and the resume falls back to the durable tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def holders(nodes: list[str]) -> list[int | None]:
    """Per rank (`nodes[r]`: rank r's node), the rank that holds its partner copy: the rank at
    the same place on the next node (its place modulo that node's size); None for every rank
    when all ranks share one node (there is no other node to hold a copy)."""
    order: list[str] = []
    ranks_of: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in ranks_of:
            order.append(node)
            ranks_of[node] = []
        ranks_of[node].append(rank)
    if len(order) < 2:
        return [None] * len(nodes)
    holder: list[int | None] = []
    for rank, node in enumerate(nodes):
        place = ranks_of[node].index(rank)
        after = ranks_of[order[(order.index(node) + 1) % len(order)]]
        holder.append(after[place % len(after)])
    return holder


def held_on(nodes: list[str], node: str) -> int:
    """How many ranks of other nodes `node` holds a copy of, all its ranks together: its share
    of shared memory besides its own ranks' (uneven nodes: [a, a, a, b] makes b hold three)."""
    return sum(1 for h in holders(nodes) if h is not None and nodes[h] == node)


@dataclass(frozen=True)
class PartnerPlan:
    """The newest step every rank can resume, from its own copy or from one a partner holds;
    `fetch`: (rank, holder) for each rank that takes its copy from a holder."""

    step: int | None
    fetch: list[tuple[int, int]] = field(default_factory=list)

    @property
    def from_partner(self) -> bool:
        return bool(self.fetch)


def plan(own: list[list[int]], held: list[dict[int, list[int]]]) -> PartnerPlan:
    """Pure: `own[r]`, the steps rank r holds complete in its own memory; `held[h]`, the steps
    of other ranks' copies rank h holds (ward -> steps). The newest step that every rank holds,
    itself or through a holder (its own copy preferred, else the lowest holder rank); a step
    no rank can take whole is never chosen."""
    world = len(own)
    holder_of: dict[tuple[int, int], int] = {}  # (ward, step) -> holder
    for h, wards in enumerate(held):
        for ward, steps in wards.items():
            if ward == h or not 0 <= ward < world:
                continue
            for step in steps:
                holder_of.setdefault((ward, step), h)
    steps = {s for mine in own for s in mine} | {s for _, s in holder_of}
    for step in sorted(steps, reverse=True):
        fetch = []
        for rank in range(world):
            if step in own[rank]:
                continue
            holder = holder_of.get((rank, step))
            if holder is None:
                break
            fetch.append((rank, holder))
        else:
            return PartnerPlan(step, fetch)
    return PartnerPlan(None)
