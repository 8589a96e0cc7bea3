"""Continuing a job in its own run dir: `run --resume RUN_DIR` (the run dir's own config), `run
CONFIG --resume RUN_DIR` (a config file, its run dir the one named), and `run CONFIG` whose run
dir already holds a job. The job keeps its id (so the ranks take up its memory copies where they
survive, and its checkpoints), its run dir and its attempt numbers; each supervisor counts its
own restarts. What changed since the run it continues is listed, and a change that breaks a
bit-exact resume is refused unless `--allow-change` names it (`policy.continuation` decides).

Also the lines `run` prints when a job ends without finishing: the one command that continues it
and what to change first.
"""

from __future__ import annotations

import argparse
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts import locks
from supervisor.host import ownership
from supervisor.launch.resolve import Resolved
from supervisor.log.events import load_events
from supervisor.policy import continuation
from supervisor.policy.continuation import Change
from supervisor.settings import loading
from supervisor.settings.config import Config, ConfigError


@dataclass
class Previous:
    """What the run dir says of the job it holds."""

    job_id: str
    supervisors: int  # how many have run it
    ended: str | None  # how the newest ended (its supervisor_exit's code name); None: no word
    config: dict[str, Any]  # its config.toml: the config it last ran with, as resolved
    world: int | None  # the ranks it last ran on (after a shrink: fewer)
    step: int | None  # the step it finished at (`done`)


@dataclass
class Continuation:
    """A job continued: the one it continues and what changed."""

    previous: Previous
    changes: list[Change] = field(default_factory=list)

    @property
    def lifetime(self) -> int:
        return self.previous.supervisors + 1

    def event(self) -> dict[str, Any]:
        """The `continued` event's facts."""
        return {
            "lifetime": self.lifetime,
            "after": self.previous.ended or "no final event",
            "changes": [c.as_event() for c in self.changes],
            "allowed": [c.key for c in self.changes if c.breaks is not None],
        }

    def lines(self, run_dir: Path) -> list[str]:
        """What `run` says before it starts: the job continued, and each setting changed."""
        ended = self.previous.ended or "no final event (its supervisor was killed?)"
        out = [
            f"continuing job {self.previous.job_id} in {run_dir} (supervisor {self.lifetime}; "
            f"the last ended: {ended})"
        ]
        if not self.previous.config:
            out.append(f"  note: {run_dir / 'config.toml'} is missing: its settings are not "
                       "compared (only the world)")  # fmt: skip
        for c in self.changes:
            allowed = f" (allowed: {c.breaks})" if c.breaks else ""
            out.append(f"  changed: {c.line}{allowed}")
        return out


def load(args: argparse.Namespace) -> Config:
    """The config `run` runs: CONFIG, or with `--resume RUN_DIR` the run dir's own config.toml
    (CONFIG instead when given), its run dir the one named; `--set` on top."""
    if args.resume is None:
        if args.config is None:
            raise ConfigError("run", "", "give CONFIG, or --resume RUN_DIR to continue a job")
        return loading.load(args.config, args.set)
    run_dir = Path(args.resume)
    source = Path(args.config) if args.config else run_dir / "config.toml"
    if args.config is None and not source.is_file():
        raise ConfigError(
            str(run_dir), "", "holds no config.toml, so no job to continue: run it with "
            "`python -m supervisor run CONFIG`, or give its CONFIG: run CONFIG --resume RUN_DIR",
        )  # fmt: skip
    raw = loading.parse_toml_file(source)
    for item in args.set:
        loading.apply_override(raw, item, str(source))
    job = raw.setdefault("job", {})
    if not isinstance(job, dict):
        raise ConfigError(str(source), "job", "expected a table")
    job["run_dir"] = str(run_dir)
    try:
        return loading.from_dict(raw, str(source))
    except ConfigError as exc:
        raise loading.with_faults_hint(exc, args.set) from None


def check(resolved: Resolved, asked: bool, allowed: list[str]) -> Continuation | None:
    """The continuation of the job in `resolved`'s run dir (None: the dir holds no job, a new
    one starts). `asked`: `--resume` said so (a run dir without a job is then an error).
    Raises ConfigError for a run dir in use, a change not allowed, nothing to continue."""
    run_dir = resolved.run_dir
    holder = locks.lock_holder(run_dir)
    if holder is not None:  # the claim would refuse it too; say it before reading its files
        raise ConfigError(str(run_dir), "", f"run dir in use: {ownership.describe(holder)}")
    before = previous(run_dir)
    if before is None:
        if asked:
            raise ConfigError(
                str(run_dir), "", "holds no job to continue (no events.jsonl with a start); "
                "start it with `python -m supervisor run CONFIG`",
            )  # fmt: skip
        return None
    # Without the config it ran with (config.toml lost), only the world can be compared.
    now = resolved.resolved_dict() if before.config else {}
    changes = continuation.differences(before.config, now, before.world, resolved.world)
    names = {n.strip() for item in allowed for n in item.split(",") if n.strip()}
    refused = continuation.refused(changes, names)
    if refused:
        raise ConfigError(str(run_dir), "", continuation.refusal(
            str(run_dir), before.job_id, refused))  # fmt: skip
    idle = continuation.nothing_to_do(before.ended, before.step, changes)
    if idle:
        raise ConfigError(str(run_dir), "", idle)
    return Continuation(before, changes)


def previous(run_dir: Path) -> Previous | None:
    """The job the run dir holds, from its events (the lock's record when they are lost); None
    when it holds none."""
    events = load_events(run_dir / "events.jsonl").events
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    job = events[starts[-1]].get("job") if starts else None
    if not isinstance(job, str):
        job = (
            locks.read_lock_holder(run_dir).get("job") if (run_dir / ".es-lock").is_file() else None
        )
    if not isinstance(job, str) or not job:
        return None
    mine = events[starts[-1] :] if starts else events
    end = next((e for e in reversed(mine) if e.get("event") == "supervisor_exit"), None)
    done = next((e for e in reversed(mine) if e.get("event") == "done"), None)
    try:
        config = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        config = {}
    return Previous(
        job_id=job,
        supervisors=max(1, len(starts)),
        ended=str(end.get("code_name")) if end else None,
        config={k: v for k, v in config.items() if isinstance(v, (dict, list))},
        world=_world(mine),
        step=done.get("step") if done and isinstance(done.get("step"), int) else None,
    )


def _world(events: list[dict]) -> int | None:
    """The ranks the job ran on last: its start's world, or its newest shrink's."""
    world = None
    for e in events:
        if e.get("event") == "start" and isinstance(e.get("world"), int):
            world = e["world"]
        elif e.get("event") == "shrink" and isinstance(e.get("world"), list) and e["world"]:
            world = e["world"][-1] if isinstance(e["world"][-1], int) else world
    return world


CONTINUABLE = ("BUDGET", "NO_PROGRESS", "INTERRUPTED", "NODES")


def hint_lines(run_dir: Path) -> list[str]:
    """After a job that ended with exit 3, 4, 5 or 6: the one command that continues it and
    what to change first (nothing for any other end)."""
    events = load_events(run_dir / "events.jsonl").events
    starts = [i for i, e in enumerate(events) if e.get("event") == "start"]
    mine = events[starts[-1] :] if starts else events
    give_up = next((e for e in reversed(mine) if e.get("event") == "give_up"), None)
    code = str(give_up.get("code_name")) if give_up else ""
    if code not in CONTINUABLE:
        return []
    failed = [e for e in mine if e.get("event") == "attempt_end"
              and e.get("outcome") not in ("success", "stopped")]  # fmt: skip
    saved = [e["step"] for e in mine if e.get("event") == "ckpt_complete"
             and isinstance(e.get("step"), int)]  # fmt: skip
    pool = give_up.get("nodes") if isinstance(give_up.get("nodes"), dict) else {}
    excluded = [str(n) for n in pool.get("excluded", [])] if isinstance(pool, dict) else []
    start = events[starts[-1]] if starts else {}
    first = continuation.first_change(
        code,
        str(give_up.get("reason") or ""),
        str(failed[-1].get("detail")) if failed else None,
        max(saved) if saved else None,
        excluded,
        start.get("max_restarts") if isinstance(start.get("max_restarts"), int) else None,
    )
    return [f"Continue: python -m supervisor run --resume {_shown(run_dir)}", f"  first: {first}"]


def _shown(path: Path) -> str:
    """Relative to the working directory where it lies below it: short enough to copy."""
    try:
        return shlex.quote(str(path.resolve().relative_to(Path.cwd().resolve())))
    except ValueError:
        return shlex.quote(str(path))
