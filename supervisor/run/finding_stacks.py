"""The stacks a `hang` or `no_progress` finding carries: every rank's, collected before the
teardown (`watch.stacks.collect`, bounded: whatever happens there, the teardown follows), and
what the finding's event and the failure's attribution take from them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts import control_msgs, stack_files
from supervisor.watch import stacks
from supervisor.watch.control import ControlServer
from supervisor.watch.rank_table import AttemptTable
from supervisor.watch.stack_text import summary_lines, where

SLACK_S = 2.0  # beyond stacks.TOTAL_S: the collection itself is late (a loaded host)


@dataclass(frozen=True)
class FindingStacks:
    """`facts`: the finding event's stack fields; `places`: rank -> its main thread's innermost
    frame (none when the collection failed)."""

    facts: dict[str, Any]
    places: dict[int, str] = field(default_factory=dict)


async def collect(
    attempt_dir: Path,
    table: AttemptTable,
    finding_ranks: Sequence[int],
    *,
    this_host: str,
    ask_remote: Callable[[int], str | None] | None,
) -> FindingStacks:
    """Every rank's stacks into `<attempt_dir>/stacks/`; never raises (a bug or a broken run dir
    must not keep the ranks alive: the facts then say what went wrong)."""
    try:
        got = await asyncio.wait_for(
            stacks.collect(
                attempt_dir, table.ranks, table.world, this_host=this_host, ask_remote=ask_remote
            ),
            stacks.TOTAL_S + SLACK_S,
        )
    except Exception as exc:
        return FindingStacks(
            {
                "stacks_dir": str(attempt_dir / stack_files.STACKS_DIR),
                "stacks_error": f"{type(exc).__name__}: {exc}",
            }
        )
    return FindingStacks(
        {
            "stacks_dir": str(got.directory),
            "stacks": summary_lines(got.stacks, finding_ranks),
            "stacks_missing": got.missing,
            "stacks_s": round(got.seconds, 3),
        },
        {st.rank: where(st.place.innermost) for st in got.stacks if st.place is not None},
    )


def remote_asker(
    control: ControlServer | None, job_id: str, attempt: int
) -> Callable[[int], str | None] | None:
    """How a rank on another host is asked for its stacks: it signals itself (the control
    channel's `signal`); None without a control channel."""
    if control is None:
        return None

    def ask(rank: int) -> str | None:
        message = control_msgs.control_message(
            job_id, attempt, rank, time.time(), "signal", 0,
            signal=int(stack_files.STACKS_SIGNAL),
        )  # fmt: skip
        return control.send(attempt, rank, message)

    return ask
