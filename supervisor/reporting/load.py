"""A run directory read back: events.jsonl, every attempt's rank-0 metrics and the resolved
config, parsed into `RunData`. The reporting's only I/O; malformed or torn lines are skipped
and counted, never raised."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.log.events import load_events, run_dir_events


class NotARunDir(ValueError):
    """A path that holds no run (no events.jsonl): reported in one line, exit 2."""


@dataclass
class StepRecord:
    """One rank-0 metrics line: a step done, when, and the timings the worker attached."""

    attempt: int
    step: int
    t: float
    dt: float
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class RunData:
    """Everything the analysis reads, already parsed: events, metrics, resolved config."""

    run_dir: Path
    events: list[dict[str, Any]]
    records: list[StepRecord]
    config: dict[str, Any]
    skipped_lines: int = 0
    notes: list[str] = field(default_factory=list)  # what the run dir lacks
    skipped_events: int = 0  # lines of events.jsonl that are no event (or fields mistyped)
    # One lifetime read alone (`lifetimes.restrict`): the newest step the ones before reached.
    prior_step: int | None = None


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; malformed or torn lines are skipped and counted, never raised."""
    run = Path(run_dir)
    try:
        path, missing = run_dir_events(run)
    except ValueError as exc:
        raise NotARunDir(f"{run}: {exc}") from None
    read = load_events(path)
    events = read.events
    records: list[StepRecord] = []
    skipped = 0
    for adir in sorted((run / "attempts").glob("[0-9]*")):
        if not adir.name.isdigit():
            continue
        got, bad = parse_metrics(adir / "metrics-0.jsonl", int(adir.name))
        records += got
        skipped += bad
    try:
        config = tomllib.loads((run / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        config = {}
    config = {k: v for k, v in config.items() if isinstance(v, dict)}  # tables only
    notes = [missing] if missing else []
    if any(e.get("event") == "events_reopened" for e in events):
        notes.append("events.jsonl was deleted or moved while the job ran: earlier events are lost")
    if read.note():
        notes.append(str(read.note()))
    return RunData(run, events, records, config, skipped, notes, read.skipped_count)


def parse_metrics(path: Path, attempt: int) -> tuple[list[StepRecord], int]:
    """(records, lines skipped): a line without an integer step and numeric t/dt is skipped."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return [], 0
    out, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step, t, dt = rec["step"], float(rec["t"]), float(rec.get("train/dt", 0.0))
            if not isinstance(step, int) or not (math.isfinite(t) and math.isfinite(dt)):
                raise ValueError(step)
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        extra = {
            k: float(v)
            for k, v in rec.items()
            if k.startswith(("train/", "startup/"))
            and k not in ("train/dt", "train/tps")
            and isinstance(v, (int, float))
        }
        out.append(StepRecord(attempt, step, t, dt, extra))
    return out, bad
