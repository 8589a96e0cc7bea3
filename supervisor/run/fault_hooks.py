"""What the job loop tells the declared fault schedule, as one interface with a do-nothing default.

A job without `[[faults]]` gets `NoFaults` and never imports `faults/` (nothing there is needed to
run a job); with them, `faults.engine.FaultEngine` is loaded and fed the same calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from supervisor.settings.config import Config
    from supervisor.watch.control import ControlServer
    from supervisor.watch.heartbeat import AttemptTable


class FaultHooks(Protocol):
    """The job's calls into a fault schedule, in the order they come."""

    def attempt_started(self, attempt: int) -> None:
        """The attempt's ranks were launched: it may be hit from now on."""
        ...

    def on_message(self, msg: dict[str, Any], table: AttemptTable, now: float) -> None:
        """A verified rank message, already folded into `table` (step and save triggers)."""
        ...

    def poke(self, table: AttemptTable, now: float) -> None:
        """A watch tick of a running attempt (time triggers)."""
        ...

    def attempt_over(self) -> None:
        """The attempt is ending: nothing more into it."""
        ...

    def hit(self, attempt: int) -> tuple[int, ...]:
        """The ranks a disruptive fault hit in `attempt` (a failure there is laid on them)."""
        ...

    def resize(self, world: int) -> None:
        """The job goes on with `world` ranks (fewer nodes): targets beyond it are skipped."""
        ...

    def close(self) -> None:
        """The job is over (a summary event; sockets closed)."""
        ...


class NoFaults:
    """A job without [[faults]]: every hook does nothing."""

    def attempt_started(self, attempt: int) -> None:
        pass

    def on_message(self, msg: dict[str, Any], table: AttemptTable, now: float) -> None:
        pass

    def poke(self, table: AttemptTable, now: float) -> None:
        pass

    def attempt_over(self) -> None:
        pass

    def hit(self, attempt: int) -> tuple[int, ...]:
        return ()

    def resize(self, world: int) -> None:
        pass

    def close(self) -> None:
        pass


def for_job(
    cfg: Config,
    world: int,
    key: str,
    job_id: str,
    heartbeat_address: str,
    emit: Callable[..., None],
    control: ControlServer | None = None,
) -> FaultHooks:
    """The job's fault hooks: the fault engine when the config declares [[faults]] (on the
    job's control channel when it has one)."""
    if not cfg.faults:
        return NoFaults()
    from faults.engine import FaultEngine

    return FaultEngine.create(cfg, world, key, job_id, heartbeat_address, emit, control)
