"""Stacks read back: faulthandler's and py-spy's text as threads and frames, and one line per rank.

Pure: text and facts in, values out (`supervisor.watch.stacks` gathers the text). Two formats:

- faulthandler (a rank's own dump, all threads): blocks `Thread 0x… (most recent call first):` or
  `Current thread 0x… (…):`, frames `  File "<path>", line <n> in <function>`, innermost first;
  threads newest first, so the main thread (the oldest) is the last block.
- `py-spy dump`: `Thread <tid> (<status>): "<name>"`, frames `    <function> (<path>:<line>)`,
  innermost first; the main thread is named `MainThread` (its tid is the process's pid).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# --- parsing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str


@dataclass(frozen=True)
class Thread:
    ident: str  # faulthandler: 0x… (pthread id); py-spy: the thread's tid
    frames: tuple[Frame, ...]  # innermost first
    name: str = ""  # py-spy only
    current: bool = False  # faulthandler: the thread the signal interrupted


_FH_HEAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FH_STACK = "Stack (most recent call first):"  # a dump of the current thread alone
_FH_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_SPY_PROCESS = re.compile(r"^Process (\d+): ")
_SPY_HEAD = re.compile(r'^Thread (0x[0-9a-fA-F]+|\d+) \(([^)]*)\)(?:: "(.*)")?$')
_SPY_FRAME = re.compile(r"^    (\S.*) \((.*):(\d+)\)$")


def detect(text: str) -> str:
    """`faulthandler`, `py-spy`, or "" (neither: nothing to parse)."""
    for line in text.splitlines():
        if _FH_HEAD.match(line) or line == _FH_STACK:
            return "faulthandler"
        if _SPY_PROCESS.match(line) or _SPY_HEAD.match(line):
            return "py-spy"
    return ""


def parse_faulthandler(text: str) -> list[Thread]:
    threads: list[Thread] = []
    head: tuple[str, bool] | None = None
    frames: list[Frame] = []
    for line in text.splitlines():
        m = _FH_HEAD.match(line)
        if m or line == _FH_STACK:
            if head is not None:
                threads.append(Thread(head[0], tuple(frames), current=head[1]))
            head = (m.group(2), m.group(1) == "Current thread") if m else ("", True)
            frames = []
            continue
        f = _FH_FRAME.match(line)
        if f and head is not None:
            frames.append(Frame(f.group(1), int(f.group(2)), f.group(3)))
    if head is not None:
        threads.append(Thread(head[0], tuple(frames), current=head[1]))
    return threads


def parse_pyspy(text: str) -> list[Thread]:
    threads: list[Thread] = []
    head: tuple[str, str] | None = None
    frames: list[Frame] = []
    for line in text.splitlines():
        m = _SPY_HEAD.match(line)
        if m:
            if head is not None:
                threads.append(Thread(head[0], tuple(frames), name=head[1]))
            head, frames = (m.group(1), m.group(3) or ""), []
            continue
        f = _SPY_FRAME.match(line)
        if f and head is not None:
            frames.append(Frame(f.group(2), int(f.group(3)), f.group(1)))
    if head is not None:
        threads.append(Thread(head[0], tuple(frames), name=head[1]))
    return threads


def main_thread(text: str) -> Thread | None:
    """The main thread of a dump in either format (None: no thread in it)."""
    kind = detect(text)
    if kind == "faulthandler":
        threads = parse_faulthandler(text)
        return threads[-1] if threads else None  # the oldest thread state is listed last
    if kind == "py-spy":
        threads = parse_pyspy(text)
        for t in threads:
            if t.name == "MainThread":
                return t
        m = next((_SPY_PROCESS.match(line) for line in text.splitlines()), None)
        pid = m.group(1) if m else None
        return next((t for t in threads if t.ident == pid), threads[0] if threads else None)
    return None


# --- where a rank is -----------------------------------------------------------------------------
_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/")
_STDLIB = re.compile(r"/lib/python3\.\d+/")


def short_path(path: str) -> str:
    """A frame's file as people read it: below site-packages for libraries
    (`torch/distributed/distributed_c10d.py`), else the last two parts (`worker/loop.py`)."""
    for marker in _LIBRARY_MARKERS:
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if path.startswith("/"):
        return "/".join(path.split("/")[-2:])
    return path


def is_own_code(path: str) -> bool:
    """Not a library's, the standard library's, or the interpreter's own (`<frozen …>`)."""
    if path.startswith("<") or any(m in path for m in _LIBRARY_MARKERS):
        return False
    return not _STDLIB.search(path)


def where(frame: Frame) -> str:
    """`worker/loop.py:90 train_step`; the function by its own name, as faulthandler gives it
    (py-spy qualifies it: `Transformer.forward`), so both read the same."""
    return f"{short_path(frame.file)}:{frame.line} {frame.func.rsplit('.', 1)[-1]}"


@dataclass(frozen=True)
class Place:
    """Where a main thread is: its innermost frame and, when that is a library's or the
    standard library's, the innermost frame of the program's own code under it."""

    innermost: Frame
    own: Frame | None = None

    def text(self) -> str:
        if self.own is None or self.own == self.innermost:
            return where(self.innermost)
        return f"{where(self.innermost)} (from {where(self.own)})"


def place_of(text: str) -> Place | None:
    """Where the main thread of a dump (either format) is; None when the dump shows no frame."""
    thread = main_thread(text)
    if thread is None or not thread.frames:
        return None
    own = next((f for f in thread.frames if is_own_code(f.file)), None)
    return Place(thread.frames[0], own)


# --- what to do per rank -------------------------------------------------------------------------
# psutil's process status, in the words of the event line.
SHOWN_STATE = {
    "running": "running",
    "sleeping": "running",  # blocked in a wait it can be woken from: it can take a signal
    "idle": "running",
    "waking": "running",
    "stopped": "stopped",
    "tracing-stop": "stopped",
    "disk-sleep": "D-state",
    "zombie": "exited",
    "dead": "exited",
}
CANNOT_RUN = frozenset({"stopped", "tracing-stop", "disk-sleep"})


def catches(sigcgt_hex: str, signum: int) -> bool:
    """Whether the `SigCgt` mask of /proc/<pid>/status has a handler for `signum`."""
    try:
        return bool(int(sigcgt_hex, 16) >> (signum - 1) & 1)
    except ValueError:
        return False


def method_for(status: str | None, handles_signal: bool) -> tuple[str, str]:
    """How to get a local rank's stacks from its process status: (`signal` | `py-spy` | `none`,
    why). A rank that cannot run (stopped, in D state) is read from outside; one that can dumps
    its own (py-spy stays the second try); one without the handler would die of the signal."""
    if status is None or status in ("zombie", "dead"):
        return "none", "its process is gone"
    if status in CANNOT_RUN:
        return "py-spy", f"it cannot run ({status})"
    if not handles_signal:
        return "py-spy", "it has no handler for the stacks signal"
    return "signal", "it can run"


# --- the event's lines ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RankStack:
    """One rank's stacks as collected: its state, how they were read, where its main thread is,
    or why there is no stack."""

    rank: int
    state: str  # running | stopped | D-state | exited | on <host> | unknown
    how: str  # signal | py-spy | none
    place: Place | None = None
    note: str = ""  # what could not be done, and why

    def line(self) -> str:
        return f"rank {self.rank} {self.describe()}"

    def describe(self) -> str:
        if self.place is not None:
            return f"{self.state} in {self.place.text()}"
        return f"{self.state}: no stack ({self.note or 'not collected'})"


def ranks_text(ranks: Sequence[int]) -> str:
    """`rank 3`, `ranks 0-2,5`."""
    ordered = sorted(ranks)
    spans: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        spans.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ("rank " if len(ordered) == 1 else "ranks ") + ",".join(spans)


def summary_lines(
    stacks: Iterable[RankStack], first: Sequence[int] = (), limit: int = 16
) -> list[str]:
    """One line per rank, ranks in the same state at the same place on one line (a job of
    thousands of ranks mostly waits in the same collective); the lines with the ranks in
    `first` (the finding's) lead. At most `limit` lines: the rest are counted on the last."""
    groups: dict[str, list[int]] = {}
    for s in stacks:
        groups.setdefault(s.describe(), []).append(s.rank)
    lead = set(first)
    order = sorted(groups.items(), key=lambda kv: (not (lead & set(kv[1])), min(kv[1])))
    lines = [f"{ranks_text(ranks)} {text}" for text, ranks in order]
    if len(lines) > limit:
        rest = [r for _, ranks in order[limit - 1 :] for r in ranks]
        lines = lines[: limit - 1] + [f"… {ranks_text(rest)} elsewhere (see the stack files)"]
    return lines
