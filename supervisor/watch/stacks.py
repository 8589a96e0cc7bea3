"""Every rank's Python stacks, collected on a `hang` or `no_progress` finding before the teardown.

Into `<attempt dir>/stacks/rank-<R>.txt` (the ranks' `ES_ATTEMPT_DIR`), per rank by its process
state (`stack_text.method_for`):

- a rank that can run gets `stack_files.STACKS_SIGNAL` and writes its own dump (worker.stack_dump:
  faulthandler, all threads); if its file does not come within SIGNAL_WAIT_S, py-spy reads it;
- a rank that cannot run (SIGSTOPped, in D state) is read from outside with `py-spy dump
  --nonblocking` (py-spy's default pauses the process first, and fails on a stopped one); when
  py-spy cannot read it, the file says why, with the kernel's state and wait channel;
- a rank on another host is asked on the control channel (when the job has one) and writes into
  the shared run dir; py-spy reads local pids only.

All ranks at once, within TOTAL_S in all; whatever happens, the caller's teardown goes on. What
could not be collected is said in the rank's file and on its line of the event.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from contracts import stack_files
from supervisor.policy.liveness import RankState
from supervisor.watch.stack_text import SHOWN_STATE, RankStack, catches, method_for, place_of

TOTAL_S = 3.0  # the whole collection, every rank
SIGNAL_WAIT_S = 1.5  # a rank's own dump: how long before py-spy tries instead
POLL_S = 0.05
PYSPY_AT_ONCE = 8
READ_BYTES = 1 << 20  # of a dump, for its line (the main thread is the last block: read it all)


@dataclass
class Collected:
    """What the collection came to: a line per rank, where the files are, how long it took."""

    directory: Path
    stacks: list[RankStack]
    seconds: float

    @property
    def missing(self) -> list[int]:
        return [s.rank for s in self.stacks if s.place is None]


def pyspy_path() -> str | None:
    """py-spy on PATH, else beside this interpreter (a virtual environment's bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else None


async def collect(
    attempt_dir: Path,
    ranks: Mapping[int, RankState],
    world: int,
    *,
    this_host: str,
    ask_remote: Callable[[int], str | None] | None = None,
    total_s: float = TOTAL_S,
    signal_wait_s: float = SIGNAL_WAIT_S,
) -> Collected:
    """Collect every rank's stacks (see the module's doc); never raises for one rank's sake."""
    c = _Collection(attempt_dir, world, this_host, ask_remote, total_s)
    await c.run(ranks, signal_wait_s)
    return Collected(c.directory, [c.done[r] for r in sorted(c.done)], c.elapsed())


class _Collection:
    def __init__(
        self,
        attempt_dir: Path,
        world: int,
        this_host: str,
        ask_remote: Callable[[int], str | None] | None,
        total_s: float,
    ) -> None:
        self.attempt_dir = attempt_dir
        self.directory = Path(stack_files.stacks_path(attempt_dir, 0)).parent
        self.world = world
        self.this_host = this_host
        self.ask_remote = ask_remote
        self.t0 = time.monotonic()
        self.deadline = self.t0 + total_s
        self.done: dict[int, RankStack] = {}
        self.pyspy = pyspy_path()
        self._slots = asyncio.Semaphore(PYSPY_AT_ONCE)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def run(self, ranks: Mapping[int, RankState], signal_wait_s: float) -> None:
        with contextlib.suppress(OSError):
            self.directory.mkdir(parents=True, exist_ok=True)
        waiting: dict[int, tuple[RankState, str]] = {}  # rank -> (state, shown state)
        outside: list[asyncio.Task] = []
        for rank in range(self.world):
            st = ranks.get(rank)
            if st is None or not st.pid:
                self._none(rank, "unknown", "it never said hello: its pid is unknown", st)
            elif st.host != self.this_host:
                self._ask_remote(st, waiting)
            else:
                task = self._local(st, waiting)
                if task is not None:
                    outside.append(task)
        await self._wait_for_files(waiting, signal_wait_s)
        for rank, (st, shown) in waiting.items():
            if rank in self.done:
                continue
            if st.host == self.this_host:  # the second try
                why = f"no dump of its own within {signal_wait_s:g} s"
                outside.append(asyncio.create_task(self._read_outside(st, shown, why)))
            else:
                self._none(
                    rank, shown,
                    f"no dump of its own within {signal_wait_s:g} s; py-spy reads local pids "
                    f"only, and it runs on {st.host}",
                    st,
                )  # fmt: skip
        if outside:
            _, pending = await asyncio.wait(outside, timeout=self.left() + 0.2)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
        for rank in range(self.world):
            if rank not in self.done:  # its py-spy outlived the bound
                st = ranks.get(rank)
                self._none(rank, "unknown", "not collected within the bound", st)

    # --- one rank ----------------------------------------------------------------------------
    def _local(
        self, st: RankState, waiting: dict[int, tuple[RankState, str]]
    ) -> asyncio.Task | None:
        status, handles = self._inspect(st.pid)
        shown = SHOWN_STATE.get(status or "dead", status or "exited")
        if status is not None and not self._ours(st.pid):
            self._none(st.rank, "unknown", f"pid {st.pid} is no process of this attempt", st)
            return None
        method, why = method_for(status, handles)
        if method == "none":
            self._none(st.rank, shown, why, st)
            return None
        if method == "signal":
            try:
                os.kill(st.pid, stack_files.STACKS_SIGNAL)
            except OSError as exc:
                why = f"it could not be signalled ({exc.strerror})"
            else:
                waiting[st.rank] = (st, shown)
                return None
        return asyncio.create_task(self._read_outside(st, shown, why))

    def _ask_remote(self, st: RankState, waiting: dict[int, tuple[RankState, str]]) -> None:
        shown = f"on {st.host}"
        if self.ask_remote is None:
            self._none(
                st.rank, shown,
                "no control channel to ask it (the job has neither [[faults]] nor a standby), "
                "and py-spy reads local pids only",
                st,
            )  # fmt: skip
            return
        err = self.ask_remote(st.rank)
        if err is not None:
            self._none(st.rank, shown, f"it could not be asked: {err}", st)
        else:
            waiting[st.rank] = (st, shown)

    @staticmethod
    def _inspect(pid: int) -> tuple[str | None, bool]:
        """(psutil status or None when gone, whether it has a handler for the stacks signal)."""
        try:
            status = psutil.Process(pid).status()
        except psutil.Error:
            return None, False
        try:
            with open(f"/proc/{pid}/status") as f:
                sigcgt = next((ln.split()[1] for ln in f if ln.startswith("SigCgt:")), "0")
        except (OSError, IndexError):
            sigcgt = "0"
        return status, catches(sigcgt, stack_files.STACKS_SIGNAL)

    @staticmethod
    def _ours(pid: int) -> bool:
        """A process of ours (a descendant: the launcher's, or an orphan we reaped as the
        subreaper): a pid a rank said is never signalled unless it is."""
        try:
            me = os.getpid()
            return any(p.pid == me for p in psutil.Process(pid).parents())
        except psutil.Error:
            return False

    async def _wait_for_files(
        self, waiting: dict[int, tuple[RankState, str]], signal_wait_s: float
    ) -> None:
        """Until every signalled rank's file is there (one listing a poll, not a stat a rank),
        or `signal_wait_s`."""
        until = min(self.deadline, time.monotonic() + signal_wait_s)
        names = {f"rank-{rank}.txt": rank for rank in waiting}
        while names:
            try:
                present = sorted(set(os.listdir(self.directory)) & set(names))
            except OSError:
                present = []
            if present:  # read off the event loop: thousands of files on a shared file system
                texts = await asyncio.to_thread(_read_all, [self.directory / n for n in present])
                for name, text in zip(present, texts, strict=True):
                    rank = names.pop(name)
                    st, shown = waiting[rank]
                    if isinstance(text, OSError):
                        why = f"its stack file cannot be read ({text.strerror})"
                        self._none(rank, shown, why, st, write=False)
                    else:
                        self._summarize(st, shown, "signal", text)
            if not names or time.monotonic() >= until:
                return
            await asyncio.sleep(POLL_S)

    async def _read_outside(self, st: RankState, shown: str, why: str) -> None:
        """py-spy (non-blocking: it works on a stopped process) into the rank's file; when it
        cannot, the file says why, with what the kernel shows of the process."""
        header = f"# rank {st.rank} (pid {st.pid} on {st.host}): {shown}; read from outside: {why}"
        if self.pyspy is None:
            failure = "py-spy not found (pip install py-spy)"
        else:
            async with self._slots:
                out, failure = await self._run_pyspy(st.pid)
            if failure is None:
                cmd = "py-spy dump --nonblocking --full-filenames"
                self._write(st.rank, f"{header}; with {cmd}\n\n{out}")
                self._summarize(st, shown, "py-spy", out)
                return
        note = f"{failure}; {kernel_view(st.pid)}"
        self._write(st.rank, f"{header}\n# no stack: {note}\n")
        self._none(st.rank, shown, note, st, write=False)

    async def _run_pyspy(self, pid: int) -> tuple[str, str | None]:
        """(output, None) or ("", why not)."""
        assert self.pyspy is not None
        budget = self.left()
        if budget <= 0:
            return "", "no time left for py-spy within the bound"
        try:
            proc = await asyncio.create_subprocess_exec(
                self.pyspy, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        except OSError as exc:
            return "", f"py-spy could not start ({exc.strerror})"
        try:
            out, err = await asyncio.wait_for(proc.communicate(), budget)
        except TimeoutError:
            await _end(proc)
            return "", f"py-spy did not finish within {budget:.1f} s"
        except asyncio.CancelledError:
            await _end(proc)
            raise
        text = out.decode(errors="replace")
        if proc.returncode != 0 or place_of(text) is None:
            said = err.decode(errors="replace").strip().splitlines()
            reason = said[0] if said else f"exit {proc.returncode}"
            if "ermission" in reason or "ptrace" in reason.lower():
                reason += " (py-spy needs ptrace permission: CAP_SYS_PTRACE or yama ptrace_scope 0)"
            return "", f"py-spy failed: {reason}"
        return text, None

    # --- results ------------------------------------------------------------------------------
    def _summarize(self, st: RankState, shown: str, how: str, text: str) -> None:
        place = place_of(text)
        if place is None:
            self._none(st.rank, shown, "its stack file shows no frame of its main thread", st,
                       write=False)  # fmt: skip
            return
        self.done[st.rank] = RankStack(st.rank, shown, how, place)

    def _none(
        self, rank: int, shown: str, note: str, st: RankState | None, write: bool = True
    ) -> None:
        self.done[rank] = RankStack(rank, shown, "none", None, note)
        if write:
            who = f" (pid {st.pid} on {st.host})" if st is not None and st.pid else ""
            self._write(rank, f"# rank {rank}{who}: {shown}\n# no stack: {note}\n")

    def _write(self, rank: int, text: str) -> None:
        """The rank's file, whole, unless it is there already: the supervisor never covers a
        dump the rank wrote itself (a late one that raced a second try)."""
        path = stack_files.stacks_path(self.attempt_dir, rank)
        tmp = os.path.join(os.path.dirname(path), f".rank-{rank}.txt.supervisor.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(text)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            os.unlink(tmp)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _read_all(paths: list[Path]) -> list[str | OSError]:
    out: list[str | OSError] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                out.append(f.read(READ_BYTES).decode(errors="replace"))
        except OSError as exc:
            out.append(exc)
    return out


def kernel_view(pid: int) -> str:
    """What /proc shows of a process that cannot be read: its state and wait channel."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        state = stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return f"/proc/{pid} cannot be read (the process is gone?)"
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "0"
    except OSError:
        wchan = "?"
    return f"/proc/{pid}/stat state {state}, wchan {wchan}"


async def _end(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), 1.0)
