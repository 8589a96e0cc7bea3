"""The job's event log: one structlog JSON event per line in events.jsonl, and the console.

Every event carries `ts` (wall clock, Unix seconds), `mono` (this host's monotonic clock) and
`level` (`level_of`), so latencies are differences of `mono` and the report can still place
events in real time.
`render` is shared by the live console and `tail`, so both read the same.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog

_LEVELS = {
    "exit": "warning",
    "hang": "warning",
    "no_progress": "warning",
    "rank_error": "error",
    "give_up": "error",
    "teardown_survivors": "error",
    "bad_messages": "warning",
    "control_refused": "warning",
    "fence_unwritten": "warning",
    "leases_lapsed": "warning",
    "node_unreachable": "error",
    "fenced_writes_removed": "warning",
    "standby_lost": "warning",
    "template_lost": "warning",
    "standby_off": "warning",
    # A node taken out of the job (a spare in its place, or fewer nodes) is worth a look.
    "node_excluded": "warning",
    "node_swapped": "warning",
    "shrink": "warning",
    # A rank that slows every step of the job (supervisor.policy.stragglers).
    "straggler": "warning",
    # The numerical guard caught a bad step (not applied) / rolled back to a checkpoint.
    "numeric_fault": "warning",
    "rollback": "warning",
}
_HIDDEN = ("ts", "mono", "level", "timestamp")


def level_of(event: dict[str, Any]) -> str:
    """An event's level: what went wrong is a warning or an error; a stop the user asked for
    (SIGINT/SIGTERM to the supervisor) is a warning at most, never an error."""
    name = str(event.get("event"))
    if name == "exit" and event.get("returncode") == 0:
        return "info"
    if name == "give_up" and event.get("code_name") == "INTERRUPTED":
        return "warning"
    return _LEVELS.get(name, "info")


def _stamp(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    event.setdefault("ts", round(time.time(), 6))
    event.setdefault("mono", round(time.monotonic(), 6))
    event["level"] = level_of(event)
    return event


class _JsonFile:
    """Writes each event as one JSON line with one write (`tail -f` and a crash see whole lines)
    and passes it on. The log outlives what happens to its file: deleted or rotated, it is
    opened again (and says so); a failed write (a full disk) never stops the job: it is said
    once on the console, and again when writing works again."""

    def __init__(self, path: Path, console: IO[str] | None) -> None:
        self.path = path
        self.console = console
        self.failing: str | None = None  # why the last write failed
        self.reopened = 0
        self._fd: int | None = None
        self._ino: int | None = None
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._ino = os.fstat(self._fd).st_ino

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        try:
            if self._moved():
                self._reopen(event)
            os.write(self._fd, _json_line(event))
        except OSError as exc:
            self._failed(exc)
        else:
            if self.failing is not None:
                self._say(f"events: writing {self.path} works again")
                self.failing = None
        return event

    def _moved(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self._ino
        except FileNotFoundError:
            return True

    def _reopen(self, event: dict[str, Any]) -> None:
        """A new file where the old one was; its first line says what happened."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._open()
        self.reopened += 1
        note = {**{k: event[k] for k in ("ts", "mono") if k in event}, "event": "events_reopened"}
        note.update(level="warning", reason="events.jsonl was deleted or moved; earlier events "
                    "are not in this file", count=self.reopened)  # fmt: skip
        os.write(self._fd, _json_line(note))
        self._say(f"events: {self.path} was deleted or moved: writing a new one")

    def _failed(self, exc: OSError) -> None:
        why = exc.strerror or str(exc)
        if self.failing is None:
            self._say(f"events: cannot write {self.path} ({why}); the job goes on, unrecorded")
        self.failing = why

    def _say(self, text: str) -> None:
        if self.console is not None:
            with contextlib.suppress(OSError, ValueError):
                self.console.write(text + "\n")
                self.console.flush()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _json_line(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()


class _Console:
    def __init__(self, colors: bool) -> None:
        self._renderer = structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=16)
        self._t0: float | None = None  # the job's `start`, for seconds since it

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> str:
        if event.get("event") == "start" and _is_number(event.get("ts")):
            self._t0 = event["ts"]
        return render(event, self._renderer, self._t0)


def render(event: dict[str, Any], renderer: Any = None, t0: float | None = None) -> str:
    """One event as a line for people: wall-clock time (and seconds since `t0`, the job's
    start), level, event name, its facts with their times readable. A hang's or no progress's
    `stacks` (a line per rank: its state, where its main thread is) follow on lines of their
    own."""
    renderer = renderer or structlog.dev.ConsoleRenderer(colors=False, pad_event_to=16)
    shown = readable({k: v for k, v in event.items() if k not in _HIDDEN}, event)
    below = shown.pop("stacks", None)
    if not (isinstance(below, list) and all(isinstance(x, str) for x in below)):
        if below is not None:
            shown["stacks"] = below
        below = []
    if shown.get("stacks_missing") == []:
        del shown["stacks_missing"]
    ts = event.get("ts")
    if _is_number(ts):
        since = f" +{ts - t0:.3f}s".ljust(12) if _is_number(t0) and ts >= t0 else ""
        shown["timestamp"] = clock(ts) + since
    shown["level"] = level_of(event)
    return renderer(None, shown["level"], shown) + "".join(f"\n    {x}" for x in below)


def clock(ts: float) -> str:
    """Unix seconds as local wall-clock `HH:MM:SS.mmm`."""
    ms = int(round(ts % 1 * 1000))
    whole = int(ts) + (1 if ms == 1000 else 0)
    return time.strftime("%H:%M:%S", time.localtime(whole)) + f".{ms % 1000:03d}"


def readable(facts: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """`facts` with raw clock readings as wall-clock `HH:MM:SS.mmm`: epoch seconds (`t`,
    `mtime`) as they are, this host's monotonic stamps (`*_mono`) through the event's own
    (ts, mono) pair. Nested tables too (a fault's `marker`)."""
    ts, mono = event.get("ts"), event.get("mono")
    out: dict[str, Any] = {}
    for key, value in facts.items():
        if isinstance(value, dict):
            value = readable(value, event)
        elif _is_number(value) and key in ("t", "mtime"):
            value = clock(value)
        elif _is_number(value) and key.endswith("_mono") and _is_number(ts) and _is_number(mono):
            value = clock(ts - mono + value)
        out[key] = value
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class EventLog:
    """The job's logger. `emit("launch", attempt=0, ...)` writes both sinks."""

    def __init__(self, path: Path | None, console: IO[str] | None = sys.stderr) -> None:
        self._file = _JsonFile(path, console) if path else None
        processors: list[Any] = [_stamp]
        if self._file:
            processors.append(self._file)
        if console is not None:
            processors.append(_Console(colors=console.isatty()))
            sink: Any = structlog.PrintLogger(console)
        else:
            processors.append(lambda *_: "")
            sink = structlog.ReturnLogger()
        self._log = structlog.wrap_logger(sink, processors=processors)

    def emit(self, event: str, **facts: Any) -> None:
        try:
            self._log.info(event, **facts)
        except OSError:
            pass  # the console is gone (a closed terminal): events.jsonl has it

    @property
    def failing(self) -> str | None:
        """Why events.jsonl cannot be written now (None: it can)."""
        return self._file.failing if self._file else None

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def run_dir_events(run_dir: str | Path) -> tuple[Path, str | None]:
    """A run dir's events.jsonl and, when it cannot be read, what that leaves out; a directory
    that is no run dir at all (none of events.jsonl, config.toml, attempts/) is a ValueError."""
    run = Path(run_dir)
    path = run / "events.jsonl"
    if path.is_file():
        return path, None
    if not ((run / "config.toml").is_file() or (run / "attempts").is_dir()):
        raise ValueError("not a run directory (no events.jsonl, config.toml or attempts/)")
    return path, (
        f"{path} is missing (deleted?): failures, detection and relaunches are unknown; "
        "what follows comes from config.toml, attempts/ and the checkpoints"
    )


# --- reading ------------------------------------------------------------------------------------
_INT = (int,)
_NUM = (int, float)
_NONE = (type(None),)
# The fields the readers (`status`, `tail`, `report`) compute with, by event kind ("*": any
# kind), and the types the supervisor writes them with. An event whose field has another type
# (a hand edit, another program's line) is skipped and counted, never a TypeError further on.
FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "*": {"event": (str,), "ts": _NUM, "mono": _NUM, "attempt": _INT + _NONE,
          "step": _INT + _NONE},
    "attempt_end": {"max_step": _INT + _NONE, "resume_step": _INT + _NONE},
    "resumed": {"restart_seconds": _NUM + _NONE, "source": (str,) + _NONE},
    "relaunch": {"after": _INT + _NONE},
    "first_step": {"t": _NUM},
    "supervisor_exit": {"code": _INT},
    "exit": {"exit_mono": _NUM + _NONE},
    "teardown": {"start_mono": _NUM},
    "hang": {"detected_mono": _NUM + _NONE},
    "no_progress": {"detected_mono": _NUM + _NONE},
    "auto_limit": {"seconds": _NUM + _NONE},
    "interval_changed": {"new": _INT, "old": _INT + _NONE, "mtbf_s": _NUM + _NONE},
    "numeric_fault": {"kind": (str,), "value": _NUM + (str,), "ranks": (list,)},
    "rollback": {"from_step": _INT, "to_step": _INT, "skip": (str,)},
}  # fmt: skip
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", type(None): "null"}


def field_problem(event: dict[str, Any]) -> str | None:
    """`resumed.step: expected an integer, got 'x'` for the first field whose type is not the
    declared one (a bool is no number here); None when every declared field is right."""
    kind = event.get("event")
    declared = {**FIELD_TYPES["*"], **FIELD_TYPES.get(kind if isinstance(kind, str) else "", {})}
    for key, types in declared.items():
        if key not in event:
            continue
        value = event[key]
        if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
            continue
        names = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in types if t is not float))
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        return f"{kind if isinstance(kind, str) else '?'}.{key}: expected {names}, got {shown}"
    return None


def parse_line(line: bytes | str) -> tuple[dict[str, Any] | None, str | None]:
    """(event, None) for a line that is a UTF-8 JSON object whose declared fields have their
    types; (None, why) otherwise; (None, None) for a blank line."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError:
            return None, "not UTF-8"
    if not line.strip():
        return None, None
    try:
        obj = json.loads(line)
    except ValueError:
        return None, "not JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    problem = field_problem(obj)
    return (None, problem) if problem else (obj, None)


@dataclass
class EventsRead:
    """A run's events as read: the good ones, and what was skipped (by reason)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # "not UTF-8", "resumed.step: …"
    unreadable: str | None = None  # why the file could not be read at all

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    @property
    def skipped_count(self) -> int:
        return sum(self.skipped.values())

    def note(self) -> str | None:
        """`events.jsonl: 2 lines skipped (1 not UTF-8; 1 resumed.step: expected …)`."""
        if self.unreadable:
            return f"events.jsonl cannot be read ({self.unreadable}): its events are left out"
        if not self.skipped:
            return None
        n = self.skipped_count
        why = "; ".join(f"{c} {w}" for w, c in self.skipped.items())
        return f"events.jsonl: {n} line{'' if n == 1 else 's'} skipped ({why})"


def load_events(path: Path) -> EventsRead:
    """Every event of a run, never raising for what a line holds: a line that is not a UTF-8
    JSON object, or an event whose fields have the wrong types, is skipped and counted. A last
    line without its newline is still being written (or torn by a crash): skipped, not counted."""
    out = EventsRead()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return out
    except IsADirectoryError:
        return out  # run_dir_events says it is missing
    except OSError as exc:  # no permission, an I/O error
        out.unreadable = exc.strerror or str(exc)
        return out
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        event, why = parse_line(line)
        if event is not None:
            out.events.append(event)
        elif why is not None and i < len(lines) - 1:
            out.skip(why)
    return out


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Events of a run; what `load_events` skips is skipped."""
    yield from load_events(path).events


def json_objects(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects among `lines` whose declared fields have their types; others skipped."""
    for line in lines:
        obj, _ = parse_line(line)
        if obj is not None:
            yield obj
