"""The job's event log: one structlog JSON event per line in events.jsonl, and the console.

Every event carries `ts` (wall clock, Unix seconds), `mono` (this host's monotonic clock) and
`level` (`level_of`), so latencies are differences of `mono` and the report can still place
events in real time.
`render` is shared by the live console and `tail`, so both read the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
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
    "standby_lost": "warning",
    "standby_off": "warning",
    # A node taken out of the job (a spare in its place, or fewer nodes) is worth a look.
    "node_excluded": "warning",
    "node_swapped": "warning",
    "shrink": "warning",
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

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> str:
        return render(event, self._renderer)


def render(event: dict[str, Any], renderer: Any = None) -> str:
    """One event as a line for people: time, level, event name, its facts. A hang's or no
    progress's `stacks` (a line per rank: its state, where its main thread is) follow on lines
    of their own."""
    renderer = renderer or structlog.dev.ConsoleRenderer(colors=False, pad_event_to=16)
    shown = {k: v for k, v in event.items() if k not in _HIDDEN}
    below = shown.pop("stacks", None)
    if not (isinstance(below, list) and all(isinstance(x, str) for x in below)):
        if below is not None:
            shown["stacks"] = below
        below = []
    if shown.get("stacks_missing") == []:
        del shown["stacks_missing"]
    ts = event.get("ts")
    if isinstance(ts, (int, float)):
        shown["timestamp"] = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 10)}"
    shown["level"] = level_of(event)
    return renderer(None, shown["level"], shown) + "".join(f"\n    {x}" for x in below)


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


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Events of a run; a torn or malformed line (a crash mid-write) is skipped."""
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115
    except FileNotFoundError:
        return
    with f:
        yield from json_objects(f)


def json_objects(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects among `lines`; a torn or malformed line is skipped."""
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            yield obj
