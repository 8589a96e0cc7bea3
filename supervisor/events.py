"""The job's event log: one structlog JSON event per line in events.jsonl, and the console.

Every event carries `ts` (wall clock, Unix seconds), `mono` (this host's monotonic clock) and
`level` (`level_of`), so latencies are differences of `mono` and the report can still place
events in real time.
`render` is shared by the live console and `tail`, so both read the same.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
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


class _JsonTee:
    """Writes each event as one JSON line, flushed (`tail -f` and crashes see it); passes it on."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        self._stream.write(json.dumps(event, default=str, separators=(",", ":")) + "\n")
        self._stream.flush()
        return event


class _Console:
    def __init__(self, colors: bool) -> None:
        self._renderer = structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=16)

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> str:
        return render(event, self._renderer)


def render(event: dict[str, Any], renderer: Any = None) -> str:
    """One event as a line for people: time, level, event name, its facts."""
    renderer = renderer or structlog.dev.ConsoleRenderer(colors=False, pad_event_to=16)
    shown = {k: v for k, v in event.items() if k not in _HIDDEN}
    ts = event.get("ts")
    if isinstance(ts, (int, float)):
        shown["timestamp"] = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 10)}"
    shown["level"] = level_of(event)
    return renderer(None, shown["level"], shown)


class EventLog:
    """The job's logger. `emit("launch", attempt=0, ...)` writes both sinks."""

    def __init__(self, path: Path | None, console: IO[str] | None = sys.stderr) -> None:
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        processors: list[Any] = [_stamp]
        if self._file:
            processors.append(_JsonTee(self._file))
        if console is not None:
            processors.append(_Console(colors=console.isatty()))
            sink: Any = structlog.PrintLogger(console)
        else:
            processors.append(lambda *_: "")
            sink = structlog.ReturnLogger()
        self._log = structlog.wrap_logger(sink, processors=processors)

    def emit(self, event: str, **facts: Any) -> None:
        self._log.info(event, **facts)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Events of a run; a torn or malformed line (a crash mid-write) is skipped."""
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                yield event
