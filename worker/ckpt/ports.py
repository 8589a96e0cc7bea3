"""What the checkpoint package reports to, as protocols of its own.

The training loop sits above worker/ckpt/: it hands in its beacon (worker.beat), its metrics log
(worker.metrics) and its check of a checkpoint's data record (worker.guard), and worker/ckpt/
imports none of those modules (tests/unit/test_import_graph.py), so the package can be used and
tested without the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Reporter(Protocol):
    """Where the phases of a load or save and a checkpoint's states go (the loop's beacon)."""

    def phase(self, phase: str, step: int) -> None: ...

    def ckpt(self, step: int, state: str) -> None: ...


class Timings(Protocol):
    """Where a save's or a copy's seconds go: the next step's metrics record."""

    def add_to_next(self, name: str, value: float) -> None: ...


# What is wrong with a checkpoint's data record (None: nothing). The record is the loop's (the
# data positions skipped, the numerical guard's baseline), so the loop says how to judge it; a
# checkpoint whose record is damaged is refused before it is loaded.
DataCheck = Callable[[Any], "str | None"]


def no_data_check(data: Any) -> str | None:
    """For a checkpointer used outside the training loop (benchmarks): any record is taken."""
    return None
