"""Acting on an attempt's plan: its processes started, watched and torn down.

Processes start in their own session, output is pumped to `output.log` with a rank prefix,
exits are reported the moment `waitpid` returns (a thread per process, not a polling loop), and
teardown ends by checking with psutil that nothing of the attempt is left on this host.

The supervisor marks itself a child subreaper, so ranks orphaned by a dying launcher become its
children and teardown still finds them; each launched process gets PR_SET_PDEATHSIG, and each
rank is asked (ES_EXIT_WITH_PARENT) to die with its parent, so a supervisor killed with SIGKILL
takes its ranks along.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from supervisor.launch.plan import LaunchPlan
from supervisor.launch.subreaper import become_subreaper

PR_SET_PDEATHSIG = 1


class ProcessLauncher:
    """The real launcher of a job's attempts (the job loop takes any object of this shape, so
    its tests can run it against a fake that starts no process)."""

    def prepare(self) -> None:
        """Once per job, before the first attempt."""
        become_subreaper()

    async def start(
        self,
        plan: LaunchPlan,
        output: Path,
        cwd: str | None,
        on_rank_exit: Callable[[int, int], None],
    ) -> Launched:
        return await Launched.start(plan, output, cwd, on_rank_exit)


def child_setup() -> None:
    """Runs in the child between fork and exec: it dies with the supervisor."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class Exit:
    returncode: int
    rank: int | None  # the local rank that ended the attempt; None for a launcher
    mono: float  # when waitpid returned


@dataclass
class TeardownResult:
    terminated: int
    killed: int
    survivors: list[int]
    seconds: float


# Every attempt started and not yet torn down: a teardown looking for its attempt's orphans among
# our descendants must not take another attempt's processes (a warm standby runs beside the
# attempt being torn down; Hydra's proxies and ranks each start their own session, so a session
# does not tell them apart: their process trees do).
_LIVE: weakref.WeakSet[Launched] = weakref.WeakSet()
# Processes the supervisor starts for itself beside the attempts (the node check's launcher): no
# teardown takes them or their descendants for its orphans (a standby ended while the node check
# before a relaunch ran counted its 9 processes as its own).
_HELPERS: set[int] = set()
# When each helper being started began. Its process is ours from the fork, but asyncio gives its
# pid an await later, and a teardown that looked in between took it for an orphan: it SIGTERMed
# the node check's mpiexec, or counted it among the survivors of a standby it never belonged to.
_STARTING: list[float] = []
# psutil's create_time() rests on the boot time in whole seconds: two clocks a second apart.
CLOCK_SLACK_S = 1.0


@contextlib.contextmanager
def helper_process(pid: int) -> Iterator[None]:
    """While in the block, `pid` and its descendants are the supervisor's own, not an attempt's."""
    _HELPERS.add(pid)
    try:
        yield
    finally:
        _HELPERS.discard(pid)


@contextlib.contextmanager
def starting_helper() -> Iterator[None]:
    """While in the block, a helper is being started: a child of ours created since is taken for
    the helper's, never for an attempt's orphan. Hold its pid with `helper_process` right after,
    with no await between the two blocks."""
    began = time.time()
    _STARTING.append(began)
    try:
        yield
    finally:
        _STARTING.remove(began)


def is_orphan(created: float, launched: float, theirs: bool, helper_since: float | None) -> bool:
    """Pure: whether a live child of ours (not a zombie), started at `created` (wall clock), is an
    orphan of the launch started at `launched`: not in another live launch's tree or a helper's
    (`theirs`), not older than the launch, and not started while a helper was being started
    (`helper_since`: when the oldest such start began; None: none is)."""
    if theirs or created < launched - CLOCK_SLACK_S:
        return False
    return helper_since is None or created < helper_since - CLOCK_SLACK_S


def _helpers_tree() -> set[int]:
    pids = set(_HELPERS)
    for pid in list(_HELPERS):
        with contextlib.suppress(psutil.Error):
            pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
    return pids


@dataclass(eq=False)  # by identity: held in _LIVE
class Launched:
    """The running processes of one attempt."""

    plan: LaunchPlan
    popens: list[subprocess.Popen]
    started: float  # monotonic
    started_wall: float
    on_rank_exit: Callable[[int, int], None] | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=400))
    exits: dict[int, int] = field(default_factory=dict)
    _known: dict[int, psutil.Process] = field(default_factory=dict)
    _future: asyncio.Future | None = None
    _output_done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    async def start(
        cls,
        plan: LaunchPlan,
        output: Path,
        cwd: str | None = None,
        on_rank_exit: Callable[[int, int], None] | None = None,
    ) -> Launched:
        loop = asyncio.get_running_loop()
        try:
            log = open(output, "ab", buffering=0)  # noqa: SIM115 - closed by the last pump
        except OSError:  # a full or read-only run dir: the ranks run all the same
            log = open(os.devnull, "ab", buffering=0)  # noqa: SIM115
        lock = threading.Lock()
        popens: list[subprocess.Popen] = []
        started, started_wall = time.monotonic(), time.time()
        try:
            for spec in plan.procs:
                popen = subprocess.Popen(
                    spec.argv,
                    env={**os.environ, **spec.env},
                    cwd=cwd or None,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own session and group: killpg reaches all
                    preexec_fn=child_setup,
                )
                popens.append(popen)
        except OSError:
            for p in popens:
                _kill_group(p.pid, signal.SIGKILL)
            log.close()
            raise
        self = cls(plan, popens, started, started_wall, on_rank_exit)
        _LIVE.add(self)
        self._future = loop.create_future()
        pumps = [len(popens)]
        for i, popen in enumerate(popens):
            spec = plan.procs[i]
            threading.Thread(
                target=self._pump,
                args=(popen, spec.label, log, lock, pumps),
                daemon=True,
                name=f"es-out-{i}",
            ).start()
            threading.Thread(
                target=self._reap, args=(loop, i, popen), daemon=True, name=f"es-wait-{i}"
            ).start()
        self.refresh()
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.popens]

    def _tree(self) -> set[int]:
        """The pids of this attempt's processes we know of or can see now."""
        pids = {*self.pids, *self._known}
        for pid in self.pids:
            with contextlib.suppress(psutil.Error):
                pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        return pids

    async def output_read(self, timeout: float) -> None:
        """Wait (up to `timeout`) until every line the ended processes wrote has been read:
        a rank's last words may still be in its pipe when its exit is seen."""
        await asyncio.get_running_loop().run_in_executor(None, self._output_done.wait, timeout)

    async def wait(self) -> Exit:
        """The first failing exit, or 0 once every process ended cleanly."""
        assert self._future is not None
        return await asyncio.shield(self._future)

    def _reap(self, loop: asyncio.AbstractEventLoop, i: int, popen: subprocess.Popen) -> None:
        rc = popen.wait()
        now = time.monotonic()
        try:
            loop.call_soon_threadsafe(self._exited, i, rc, now)
        except RuntimeError:
            pass  # the loop is gone: the supervisor is exiting

    def _exited(self, i: int, rc: int, now: float) -> None:
        rank = self.plan.procs[i].rank
        self.exits[i] = rc
        if rank is not None and self.on_rank_exit:
            self.on_rank_exit(rank, rc)
        fut = self._future
        if fut is None or fut.done():
            return
        if rc != 0:
            fut.set_result(Exit(rc, rank, now))
        elif len(self.exits) == len(self.popens):
            fut.set_result(Exit(0, None, now))

    def _pump(self, popen: subprocess.Popen, label: str, log, lock, pumps: list[int]) -> None:
        prefix = label.encode()
        hydra = self.plan.line_joiner()
        assert popen.stdout is not None
        for raw in itertools.chain(iter(popen.stdout.readline, b""), [None]):
            if raw is None:  # the end: what ranks left without a newline
                lines = hydra.flush() if hydra else []
            else:
                lines = hydra.feed(raw) if hydra else [raw]
            for line in lines:
                if not line.endswith(b"\n"):
                    line += b"\n"
                with lock, contextlib.suppress(OSError):  # a full disk: keep draining
                    log.write(prefix + line)
                self.tail.append(label + line.decode(errors="replace").rstrip("\n"))
        popen.stdout.close()
        with lock:
            pumps[0] -= 1
            if pumps[0] == 0:
                log.close()
                self._output_done.set()

    def refresh(self, extra: list[int] = ()) -> None:
        """Remember every process of this attempt we can see now (teardown kills them all)."""
        roots = [*self.pids, *extra]
        for pid in roots:
            try:
                proc = psutil.Process(pid)
                if pid in extra and proc.create_time() < self.started_wall - 1:
                    continue  # a recycled pid, not ours
                self._known.setdefault(pid, proc)
                for child in proc.children(recursive=True):
                    self._known.setdefault(child.pid, child)
            except psutil.Error:
                continue

    def signal_stop(self) -> None:
        """Ask the ranks to checkpoint and exit (through the launcher where there is one)."""
        sig = self.plan.stop_signal
        for p in self.popens:
            if p.returncode is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    async def teardown(self, grace: float, extra: list[int] = ()) -> TeardownResult:
        """SIGTERM to the groups and every known process, `grace` s, SIGKILL, then verify."""
        t0 = time.monotonic()
        self.refresh(list(extra))
        procs = self._alive(include_orphans=True)
        terminated = len(procs)
        for pid in self.pids:
            _kill_group(pid, signal.SIGTERM)
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        killed = 0
        if procs:
            _, alive = await asyncio.to_thread(psutil.wait_procs, procs, timeout=grace)
            await self._kill_ranks_first(alive)
            for pid in self.pids:
                _kill_group(pid, signal.SIGKILL)
            killed = len(alive)
            if alive:
                await asyncio.to_thread(psutil.wait_procs, alive, timeout=5)
        # Our own children: wait for the reaper threads so exit codes are collected.
        for p in self.popens:
            try:
                await asyncio.wait_for(asyncio.to_thread(p.wait), 5)
            except TimeoutError:
                pass
        reap_orphans(exclude={pid for run in [self, *_LIVE] for pid in run.pids})
        survivors = [p.pid for p in self._alive(include_orphans=True)]
        if not survivors:
            _LIVE.discard(self)
        return TeardownResult(terminated, killed, survivors, time.monotonic() - t0)

    async def _kill_ranks_first(self, alive: list[psutil.Process]) -> None:
        """SIGKILL what outlived the grace, the launcher's own processes last (`kill_order`)."""
        parents = _parents(alive)
        by_pid = {proc.pid: proc for proc in alive}
        now, spared = kill_order(parents, self.launcher_pids)
        for proc in [by_pid[pid] for pid in now] + [p for p in alive if p.pid not in parents]:
            _signal(proc, signal.SIGKILL)
        if spared:
            wait = [by_pid[pid] for pid in spared]
            _, left = await asyncio.to_thread(
                psutil.wait_procs, wait, timeout=self.plan.launcher_exit_s
            )
            for proc in left:
                _signal(proc, signal.SIGKILL)

    def worker_pids(self) -> list[int]:
        """This launch's processes alive here now that are neither a launcher nor a launcher's
        own child (Hydra's proxy): the ranks, and anything they started."""
        self.refresh()
        ranks, _ = kill_order(_parents(self._alive(include_orphans=False)), self.launcher_pids)
        return ranks

    @property
    def launcher_pids(self) -> list[int]:
        """The processes we started that are a launcher (mpiexec, srun), not a rank."""
        return [
            p.pid for p, spec in zip(self.popens, self.plan.procs, strict=True) if spec.rank is None
        ]

    def _alive(self, include_orphans: bool) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for pid, proc in self._known.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    found[pid] = proc
            except psutil.Error:
                continue
        if include_orphans:
            try:  # the children before the others' trees: one started in between is theirs
                children = psutil.Process().children(recursive=True)
            except psutil.Error:
                children = []
            others = {pid for run in list(_LIVE) if run is not self for pid in run._tree()}
            others |= _helpers_tree()
            helper_since = min(_STARTING, default=None)
            for child in children:
                try:
                    if child.pid in found or child.status() == psutil.STATUS_ZOMBIE:
                        continue
                    created = child.create_time()
                except psutil.Error:  # gone meanwhile: nothing left to end or count
                    continue
                if is_orphan(created, self.started_wall, child.pid in others, helper_since):
                    found[child.pid] = child
        return list(found.values())


def kill_order(
    parents: Mapping[int, int], launchers: Collection[int]
) -> tuple[list[int], list[int]]:
    """Pure: of the processes that outlived the teardown's grace (pid -> parent pid), those to
    SIGKILL at once (the ranks, and anything else) and those spared for the plan's
    `launcher_exit_s` to end by themselves once the ranks are gone: a launcher (`launchers`)
    and its own children (Hydra's proxies, ssh). Hydra's proxy SIGKILLed leaves
    `/tmp/hydra_hwloc_xmlfile_*` on its node (one per killed attempt, issue 17); once its ranks
    are dead it exits and removes it. A SIGSTOPped or stalled rank keeps them all alive past
    the grace."""
    spared = sorted(p for p, ppid in parents.items() if p in launchers or ppid in launchers)
    return sorted(p for p in parents if p not in spared), spared


def _parents(procs: list[psutil.Process]) -> dict[int, int]:
    """pid -> parent pid of those of `procs` still there to ask."""
    parents: dict[int, int] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            parents[proc.pid] = proc.ppid()
    return parents


def reap_orphans(exclude: set[int]) -> None:
    """Collect zombies reparented to us (we are a subreaper), never our Popen children."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for child in children:
        if child.pid in exclude:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(proc: psutil.Process, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass
