"""What the engine uses of the supervisor, as structural types: faults/ imports nothing of it.

The supervisor hands the engine its control channel and, on every call, its table of the
attempt's ranks; the engine only reads the table and only sends on the channel.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol


class ControlChannel(Protocol):
    """Signed commands to single ranks (the process that claimed `attempt/rank`); sends never
    block."""

    def send(self, attempt: int, rank: int, message: dict[str, Any]) -> str | None:
        """Queue one command for a rank; None when sent, else why not ("... not connected ..."
        when the rank's socket is not connected yet)."""
        ...

    def close(self) -> None: ...


class RankView(Protocol):
    """What the supervisor knows of one rank of the attempt."""

    @property
    def rank(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def pid(self) -> int: ...  # 0 until its `hello`

    @property
    def phase(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def exited(self) -> bool: ...  # its process is gone


class RankTable(Protocol):
    """The supervisor's view of one attempt's ranks, as the messages so far left it."""

    @property
    def attempt(self) -> int: ...

    @property
    def ranks(self) -> Mapping[int, RankView]: ...  # the ranks heard from

    @property
    def max_step(self) -> int | None: ...  # the highest step reported

    @property
    def done_ranks(self) -> Collection[int]: ...  # the ranks that said done
