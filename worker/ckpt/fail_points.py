"""Where a save can be made to fail on purpose (`ES_INJECT`, contracts.inject): the calls the
checkpoint code makes at each point, and the do-nothing ones of a run that arms none.

The worker passes in the object that acts (worker.hooks); the checkpoint code knows only this
shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from contracts.inject import AsyncPhase


class SaveFailPoints(Protocol):
    """The points of a save, called on the thread that reaches them."""

    @property
    def write_delay_s(self) -> float:
        """An async save's background write starts this late."""
        ...

    def after_write(self, step: int) -> None:
        """A sync save: this rank's shards are written, the marker is not."""

    def in_async_phase(self, phase: AsyncPhase, step: int) -> None:
        """An async save of `step` has reached `phase`."""

    def before_shard(self, step: int, path: Path) -> None:
        """The save of `step` is about to write this rank's shard file `path`."""

    def in_memory_copy(self, step: int) -> None:
        """The memory copy of `step` has copied the bytes but not sealed its slot."""

    def partner_held(self, step: int, path: Path, offset: int) -> None:
        """A partner copy of `step` is sealed in `path`; a tensor's bytes start at `offset`."""


class NoFailPoints:
    """A save with nothing armed: every point does nothing."""

    write_delay_s: float = 0.0

    def after_write(self, step: int) -> None:
        pass

    def in_async_phase(self, phase: AsyncPhase, step: int) -> None:
        pass

    def before_shard(self, step: int, path: Path) -> None:
        pass

    def in_memory_copy(self, step: int) -> None:
        pass

    def partner_held(self, step: int, path: Path, offset: int) -> None:
        pass
