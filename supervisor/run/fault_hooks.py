"""What the job loop tells the declared fault schedule, as one interface with a do-nothing default.

A job without `[[faults]]` gets `NoFaults` and never imports `faults/` (nothing there is needed to
run a job); with them, `faults.FaultEngine` is loaded, handed the job's control channel (one of
its own when the job has none), and fed the same calls.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from supervisor.host import memdir
from supervisor.launch import hosts
from supervisor.settings import worker_flags
from supervisor.watch.control import ControlServer, bind_for

if TYPE_CHECKING:
    from supervisor.settings.config import Config
    from supervisor.watch.rank_table import AttemptTable


class FaultHooks(Protocol):
    """The job's calls into a fault schedule, in the order they come."""

    def attempt_started(self, attempt: int) -> None:
        """The attempt's ranks were launched: it may be hit from now on."""
        ...

    def on_message(self, msg: dict[str, Any], table: AttemptTable, now: float) -> None:
        """A verified rank message, already folded into `table` (step and save triggers)."""
        ...

    def fire_due(self, table: AttemptTable, now: float) -> None:
        """A watch tick of a running attempt: fire what is due (time triggers)."""
        ...

    def attempt_over(self) -> None:
        """The attempt is ending: nothing more into it."""
        ...

    def ranks_faulted(self, attempt: int) -> tuple[int, ...]:
        """The ranks a disruptive fault hit in `attempt` (a failure there is laid on them)."""
        ...

    def resize(self, world: int) -> None:
        """The job goes on with `world` ranks (fewer nodes): targets beyond it are skipped."""
        ...

    def set_nodes(self, names: Sequence[str]) -> None:
        """The job's nodes now, in rank order (`node:N` targets names[N])."""
        ...

    def nodes_down(self) -> frozenset[str]:
        """The nodes a `node_loss` took away: down (their node check fails) until the job ends."""
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

    def fire_due(self, table: AttemptTable, now: float) -> None:
        pass

    def attempt_over(self) -> None:
        pass

    def ranks_faulted(self, attempt: int) -> tuple[int, ...]:
        return ()

    def resize(self, world: int) -> None:
        pass

    def set_nodes(self, names: Sequence[str]) -> None:
        pass

    def nodes_down(self) -> frozenset[str]:
        return frozenset()

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
    others: Callable[[], Sequence[AttemptTable]] | None = None,
) -> FaultHooks:
    """The job's fault hooks: the fault engine when the config declares [[faults]], on the
    job's control channel when it has one (a standby uses it too), else on one of its own.
    `others`: the rank tables of the job's other live attempts (its standby), whose ranks on a
    node a `node_loss` takes die with it."""
    if not cfg.faults:
        return NoFaults()
    from faults import FaultEngine

    owns_control = control is None
    if control is None:
        control = ControlServer(key.encode(), job_id, *bind_for(heartbeat_address))
    mem_env = None
    if memdir.wanted(cfg.worker.flags):  # where the ranks keep it (a node_loss takes it away)
        mem_env = {**os.environ, **cfg.launch.env, **memdir.rank_env(cfg.launch)}
    return FaultEngine(
        list(cfg.faults),
        job_id=job_id,
        world=world,
        ranks_per_node=cfg.launch.ranks_per_node,
        ckpt_dir=worker_flags.ckpt_root(cfg),
        this_host=hosts.this_host(),
        emit=emit,
        control=control,
        owns_control=owns_control,
        mem_env=mem_env,
        others=others,
    )
