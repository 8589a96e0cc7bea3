"""Which node an attempt's failure is laid on: the facts the attempt saw, gathered for
`nodes.attribute` (the pure rule that weighs them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from supervisor.policy import nodes
from supervisor.policy.liveness import Finding
from supervisor.watch.rank_table import AttemptTable


def attribute(
    table: AttemptTable,
    finding: Finding | None,
    *,
    error_at: Mapping[int, float],
    stack_places: Mapping[int, str],
    tail: Sequence[str],
    injected: tuple[int, ...],
    active: Sequence[str],
    ranks_per_node: int,
) -> nodes.Attribution:
    """The node the failure is laid on. `finding`: what ended the watch (None: an exit);
    `error_at`: rank -> when its error came (monotonic); `stack_places`: rank -> its main
    thread's innermost frame; `tail`: the ranks' last output lines; `injected`: the ranks a
    disruptive fault hit; `active`: the attempt's nodes in rank order."""
    pids = {r: st.pid for r, st in table.ranks.items()}
    stalled: tuple[int, ...] = ()
    if finding is not None and finding.kind == "no_progress":
        places = {r: w for r, w in stack_places.items() if r in finding.ranks}
        stalled = nodes.outside_collectives(places)
    gone = {r: st.exited_at for r, st in table.ranks.items() if st.exited}
    first_gone = min(gone.values(), default=float("inf"))
    facts = nodes.FailureFacts(
        kind=finding.kind if finding else "exit",
        finding_ranks=finding.ranks if finding else (),
        finding_node=finding.node if finding else None,
        error_ranks=nodes.own_errors(table.errors, error_at, first_gone),
        first_exited=nodes.first_exited(gone),
        launcher_named=nodes.launcher_named_ranks(tail, pids),
        injected=injected,
        stalled_outside_collectives=stalled,
    )
    return nodes.attribute(facts, active, ranks_per_node)
