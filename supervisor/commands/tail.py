"""`tail`: a run's events.jsonl for people, as it grows (--follow), with the many-a-step kinds
hidden unless asked for."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from contracts.config_table import ConfigError
from contracts.exit_codes import ExitCode
from supervisor.log import events as events_mod

TAIL_HIDDEN = ("phase", "ckpt_complete")  # many a step: `tail --all` or `--event` shows them


@dataclass
class TailView:
    """Which events `tail` shows and how: every kind but TAIL_HIDDEN (all with --all), or only
    the kinds asked for; times as seconds since the newest `start` seen."""

    show_all: bool = False
    names: frozenset[str] = frozenset()
    t0: float | None = None
    hidden: int = 0
    kinds: set[str] = field(default_factory=set)  # every kind seen (for a name that matched none)
    lifetimes: int = 0  # the supervisors seen so far (a `start` each)

    def take(self, event: dict) -> bool:
        """Note the event (the start it counts from, its kind); whether it is shown."""
        kind = str(event.get("event"))
        self.kinds.add(kind)
        if kind == "start":
            self.lifetimes += 1
        if kind == "start" and isinstance(event.get("ts"), (int, float)):
            self.t0 = event["ts"]
        if self.names:
            return kind in self.names
        if kind in TAIL_HIDDEN and not self.show_all:
            self.hidden += 1
            return False
        return True

    def notes(self, skipped: str | None) -> list[str]:
        """What the lines shown leave out: hidden kinds, skipped lines, names that matched none."""
        out = [skipped] if skipped else []
        if self.hidden:
            out.append(f"{self.hidden} {'/'.join(TAIL_HIDDEN)} events hidden (--all shows them)")
        missing = sorted(self.names - self.kinds)
        if missing:
            known = ", ".join(sorted(self.kinds)) or "none"
            out.append(f"no {', '.join(missing)} events in this run; its events: {known}")
        return out


def cmd_tail(args: argparse.Namespace) -> int:
    path, missing = events_path(args.run_dir)
    if missing:
        print(f"note: {missing}", file=sys.stderr)
        if not args.follow:
            return ExitCode.DONE
        while not path.is_file():  # a running job writes a new one with its next event
            time.sleep(0.25)
    names = frozenset(n.strip() for item in args.event for n in item.split(",") if n.strip())
    view = TailView(show_all=args.all, names=names)
    read = events_mod.EventsRead()
    data = path.read_bytes()
    # Only whole lines: a last line without its newline is still being written.
    offset = data.rfind(b"\n") + 1
    lines = data[:offset].split(b"\n")
    shown = [text for line in lines if (text := _tail_line(line, view, read, args.json))]
    for text in shown[-args.lines :] if args.lines else shown:
        print(text)
    sys.stdout.flush()
    for note in view.notes(read.note()):
        print(f"note: {note}", file=sys.stderr)
    if not args.follow:
        return ExitCode.DONE
    pending = b""
    while True:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        offset += len(chunk)
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            before = read.skipped_count
            text = _tail_line(line, view, read, args.json)
            if text:
                print(text)
            elif read.skipped_count > before:
                print(f"note: skipped a line ({next(reversed(read.skipped))})", file=sys.stderr)
        sys.stdout.flush()
        time.sleep(0.25)


def _tail_line(line: bytes, view: TailView, read: events_mod.EventsRead, raw: bool) -> str:
    """The line `tail` prints for one line of events.jsonl ("" for none); a line that is no
    event is counted in `read`."""
    event, why = events_mod.parse_line(line)
    if event is None:
        if why:
            read.skip(why)
        return ""
    shown = view.take(event)
    head = lifetime_head(event, view.lifetimes) if not raw else ""
    if not shown:
        return head
    if raw:
        return line.decode().strip()
    text = "\n".join(map(_capped, events_mod.render(event, t0=view.t0).split("\n")))
    return f"{head}\n{text}" if head else text


def lifetime_head(event: dict, number: int) -> str:
    """The line that parts one supervisor's events from the one before in the same run dir
    (a job continued, or run again after its supervisor was killed); its times count from its
    own start."""
    if event.get("event") != "start" or number < 2:
        return ""
    how = "continues" if event.get("continues") else "started again"
    return f"── supervisor {number} of this run dir: job {event.get('job', '?')} ({how}) ──"


TAIL_LINE_MAX = 4000  # characters of one printed line; a hand-edited 50 MB value is not shown


def _capped(text: str) -> str:
    if len(text) <= TAIL_LINE_MAX:
        return text
    more = len(text) - TAIL_LINE_MAX
    return f"{text[:TAIL_LINE_MAX]}… ({more} more characters; --json shows the line whole)"


def events_path(run_dir: str) -> tuple[Path, str | None]:
    """RUN_DIR's events.jsonl and a note when it is missing; no run dir is a user error."""
    try:
        return events_mod.run_dir_events(run_dir)
    except ValueError as exc:
        raise ConfigError(run_dir, "", str(exc)) from None
