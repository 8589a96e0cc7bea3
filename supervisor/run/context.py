"""What every attempt of one job is handed: the job's context, and the launcher's shape.

Two attempts may be alive at once (a warm standby beside the running one); they share nothing
but the `JobContext` the job gives each. `Launcher` and `Running` say what an attempt needs of
the launch layer, so the job loop's unit tests can hand it a fake.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from contracts import env_names, fences
from supervisor.host import memdir
from supervisor.launch import malloc_env
from supervisor.launch.plan import LaunchPlan
from supervisor.launch.processes import Exit, TeardownResult
from supervisor.launch.resolve import Resolved
from supervisor.policy.access import access_for
from supervisor.run.fault_hooks import FaultHooks
from supervisor.run.intervals import IntervalKeeper
from supervisor.settings import worker_flags
from supervisor.watch import relays
from supervisor.watch.control import ControlServer


class Running(Protocol):
    """A started attempt's processes as an attempt uses them (`processes.Launched` is one)."""

    plan: LaunchPlan
    started: float  # monotonic
    tail: Sequence[str]  # the newest lines of the ranks' output

    @property
    def pids(self) -> list[int]: ...

    async def wait(self) -> Exit:
        """The first failing exit, or 0 once every process ended cleanly."""
        ...

    def refresh(self, extra: list[int] = ...) -> None: ...

    def signal_stop(self) -> None:
        """Ask the ranks to save and exit."""
        ...

    def worker_pids(self) -> list[int]:
        """The ranks' processes alive on this host (no launcher, no launcher's proxy)."""
        ...

    async def teardown(self, grace: float, extra: list[int] = ...) -> TeardownResult: ...

    async def output_read(self, timeout: float) -> None:
        """Until what the ended processes wrote has all been read (or `timeout`)."""
        ...


class Launcher(Protocol):
    """Starts attempts (`processes.ProcessLauncher`; a fake in the job loop's unit tests)."""

    def prepare(self) -> None: ...

    async def start(
        self,
        plan: LaunchPlan,
        output: Path,
        cwd: str | None,
        on_rank_exit: Callable[[int, int], None],
    ) -> Running: ...


@dataclass(frozen=True)
class JobContext:
    """What every attempt of one job uses: the job as resolved, its identity, its services."""

    resolved: Resolved
    job_id: str
    key: str
    heartbeat_address: str
    launcher: Launcher
    faults: FaultHooks
    emit: Callable[..., None]
    drain: Callable[[], object]  # hand the rank messages waiting now to their attempts
    console: IO[str] | None
    control: ControlServer | None = None  # signed commands to ranks (faults, standby go/exit)
    restarts_left: Callable[[], int] = lambda: 1  # the job's (a straggler's relaunch is one)
    intervals: IntervalKeeper | None = None  # "auto" checkpoint intervals, when there are any
    # The nodes where the job's own standby, prepared ranks or fork template are starting now
    # (their imports take the node's cores: its ranks' straggler scores wait).
    starting: Callable[[], set[str]] = set

    def base_env(self) -> dict[str, str]:
        """[launch] env and what the supervisor adds to it that a process reads as it starts (the
        malloc tunable): a template's and its ranks' (a forked rank runs with its template's)."""
        launch = self.resolved.cfg.launch
        huge_pages = malloc_env.huge_pages_env(launch.huge_pages, launch.env, os.environ)
        return {**launch.env, **huge_pages}

    def rank_env(self, attempt: int, attempt_dir: Path, standby: bool) -> dict[str, str]:
        """The environment of one attempt's ranks: `base_env`, then the contract's names."""
        cfg = self.resolved.cfg
        env = {
            **self.base_env(),
            env_names.ENV_JOB_ID: self.job_id,
            env_names.ENV_ATTEMPT: str(attempt),
            env_names.ENV_HEARTBEAT_ADDR: self.heartbeat_address,
            env_names.ENV_HEARTBEAT_KEY: self.key,
            env_names.ENV_ATTEMPT_DIR: str(attempt_dir),
            env_names.ENV_HEARTBEAT_INTERVAL: repr(cfg.heartbeat.interval_s),
            env_names.ENV_EXIT_WITH_PARENT: "1",
            env_names.ENV_UMASK: access_for(cfg.job.share_with_group).umask_text,
        }
        if self.control is not None:
            env[env_names.ENV_CONTROL_ADDR] = self.control.address
            if (lease := cfg.heartbeat.lease_seconds()) > 0:
                env[env_names.ENV_LEASE_S] = repr(lease)
        if standby:
            env[env_names.ENV_STANDBY] = "1"
        if self.intervals is not None:  # the latest "auto" intervals
            env.update(self.intervals.rank_env(attempt, standby))
        env.update(memdir.rank_env(cfg.launch))
        world, ranks_per_node = self.resolved.world, cfg.launch.ranks_per_node
        if relays.relay_wanted(cfg.heartbeat.relay, world, ranks_per_node):
            env[env_names.ENV_HEARTBEAT_RELAY] = "1"
        return env

    def let_go(self, attempt: int, why: str) -> None:
        """An attempt's processes are gone: fenced (if no finding fenced it earlier), its
        control identities claimed by none again, and what fenced attempts wrote after their
        fences removed (`fenced_writes_removed`: a cut-off rank's late checkpoints)."""
        self.fence(attempt, why)
        if self.control is not None:
            self.control.forget(attempt)
        root = worker_flags.ckpt_root(self.resolved.cfg)
        swept = fences.sweep(root) if root is not None else []
        if swept:
            self.emit("fenced_writes_removed", steps=swept, ckpt_dir=str(root))

    def first_unfenced(self) -> int:
        """The first attempt number none of this job's fence records names. A job continued
        in a run dir whose `attempts/` was removed would else number its attempts from 0 again,
        and all they saved would count as written after those attempts' fences: removed."""
        root = worker_flags.ckpt_root(self.resolved.cfg)
        return fences.after(fences.read_all(root), self.job_id) if root is not None else 0

    def fence(self, attempt: int, why: str) -> None:
        """Attempt `attempt` is over for the job (a finding ended it, or it ended): its ranks'
        leases are renewed no more, and what they write from now on, reached or not, is never
        used: the fence record is on disk before anything resumes (contracts.fences)."""
        if self.control is not None:
            self.control.fence(attempt)
        root = worker_flags.ckpt_root(self.resolved.cfg)
        if root is None:
            return
        record = fences.Fence(self.job_id, attempt, time.time(), why)
        try:
            fences.write(root, record)
        except OSError as exc:  # no checkpoint dir yet (nothing saved), or it cannot be written
            if root.is_dir():
                self.emit("fence_unwritten", attempt=attempt, error=exc.strerror or str(exc))
