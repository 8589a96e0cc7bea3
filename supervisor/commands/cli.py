"""`python -m supervisor run|validate|tail|status`: the supervisor's commands.

User errors (bad config, bad flags, a missing launcher) print one line and exit 2, without a
traceback. The supervisor never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from contracts import ckpt_files as ckpt_files
from contracts import locks
from contracts.exit_codes import ExitCode
from supervisor.commands import preflight
from supervisor.host import ownership
from supervisor.log import console
from supervisor.log import events as events_mod
from supervisor.run import job as job_mod
from supervisor.settings import config as config_mod

# What each exit status means to `run` (and `--help`); every ExitCode has a line (a test holds
# this), and each command lists the codes it can end with.
EXIT_MEANINGS: dict[ExitCode, str] = {
    ExitCode.DONE: "done: the worker finished",
    ExitCode.ERROR: "internal error (a bug, or an unexpected failure of this host)",
    ExitCode.USAGE: "bad config or usage, missing launcher, or the worker rejected its flags",
    ExitCode.BUDGET: "restart budget exhausted ([restart] max_restarts)",
    ExitCode.NO_PROGRESS: "no progress: [restart] max_same_resume attempts in a row completed "
    "no checkpoint newer than the one each resumed from",
    ExitCode.INTERRUPTED: "interrupted: SIGINT, SIGTERM or SIGHUP to the supervisor (the ranks "
    "were asked to save and stop)",
    ExitCode.NODES: "too few nodes: nodes excluded, no spare left, and no shrink (or below "
    "[restart] min_nodes)",
}
INTERRUPTED_BY_USER = 130  # Ctrl-C in a command that starts nothing: the shell's 128 + SIGINT
READ_ONLY = {
    ExitCode.ERROR: EXIT_MEANINGS[ExitCode.ERROR],
    ExitCode.USAGE: "not a run directory, or bad usage",
}
COMMAND_EXITS: dict[str, dict[int, str]] = {
    "run": {},  # every code, as EXIT_MEANINGS says
    "validate": {
        ExitCode.DONE: "the config is valid (notes may follow)",
        ExitCode.ERROR: EXIT_MEANINGS[ExitCode.ERROR],
        ExitCode.USAGE: "bad config or usage, or a missing launcher: one line says which key",
        INTERRUPTED_BY_USER: "Ctrl-C",
    },
    "tail": {
        ExitCode.DONE: "the events shown (with --follow: until Ctrl-C)",
        **READ_ONLY,
    },
    "status": {ExitCode.DONE: "the status shown", **READ_ONLY, INTERRUPTED_BY_USER: "Ctrl-C"},
    "report": {
        ExitCode.DONE: "report written",
        **READ_ONLY,
        ExitCode.USAGE: "not a run directory, the report cannot be written, or bad usage",
        INTERRUPTED_BY_USER: "Ctrl-C",
    },
    "experiment": {
        **EXIT_MEANINGS,
        ExitCode.DONE: "every phase finished (with --dry-run: every phase is valid)",
    },
}
EXIT_LEADS = {"experiment": "the first phase that did not finish ends the experiment with its code"}


def exit_codes_text(command: str | None = None) -> str:
    """The `exit status:` epilog of `--help`: every code (no command), or the command's own."""
    codes = COMMAND_EXITS.get(command or "run") or EXIT_MEANINGS
    lead = EXIT_LEADS.get(command or "")
    lines = [f"exit status ({lead}):" if lead else "exit status:"]
    lines += [f"  {int(code):<3} {text}" for code, text in sorted(codes.items())]
    if command is None:
        lines += [
            f"  {INTERRUPTED_BY_USER} Ctrl-C in validate, status or report",
            "each command's --help lists the codes it can end with",
        ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="python -m supervisor",
        description="Keeps a distributed training job making progress: launches its ranks, "
        "watches exits and heartbeats, tears down and relaunches until done.",
        epilog=exit_codes_text(),
        formatter_class=fmt,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run a job until done",
        epilog=exit_codes_text("run"),
        formatter_class=fmt,
        description="Launch the job of CONFIG and keep it going until done.",
    )
    run.add_argument("config", metavar="CONFIG", help="the job's TOML file")
    _add_set(run)
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and the launch command; start nothing",
    )
    run.add_argument("--quiet", action="store_true", help="no events on the console")
    run.add_argument(
        "--no-report",
        action="store_true",
        help="skip the end-of-run report (report.md, report.png and its printed tables)",
    )

    val = sub.add_parser(
        "validate",
        help="check a config (a job's or an experiment's); launch nothing",
        epilog=exit_codes_text("validate"),
        formatter_class=fmt,
        description="Check CONFIG (keys, types, values, launcher); exit 2 on "
        "the first problem, naming the file and the key.",
    )
    val.add_argument("config", metavar="CONFIG")
    _add_set(val)

    tail = sub.add_parser(
        "tail",
        help="show a run's events",
        epilog=exit_codes_text("tail"),
        formatter_class=fmt,
        description="Render RUN_DIR/events.jsonl for people.",
    )
    tail.add_argument("run_dir", metavar="RUN_DIR")
    tail.add_argument("-f", "--follow", action="store_true", help="keep following new events")
    tail.add_argument("--json", action="store_true", help="print the raw JSON lines")
    tail.add_argument(
        "-n", "--lines", type=_non_negative, default=0, help="only the last N events shown"
    )
    tail.add_argument(
        "--all",
        action="store_true",
        help=f"show every event, {' and '.join(TAIL_HIDDEN)} too (hidden by default: a line "
        "per rank and phase change or checkpoint)",
    )
    tail.add_argument(
        "--event",
        action="append",
        default=[],
        metavar="NAME",
        help="only events of this kind, e.g. --event fault --event attempt_end (repeatable, "
        "or comma-separated)",
    )

    st = sub.add_parser(
        "status",
        help="where a run stands",
        epilog=exit_codes_text("status"),
        formatter_class=fmt,
        description="Attempts, restarts left, current step, newest complete "
        "checkpoint, last failure and why.",
    )
    st.add_argument("run_dir", metavar="RUN_DIR")
    _add_report_commands(sub, fmt)  # report / experiment: supervisor.commands.report_cli
    return p


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of events, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (all) or more, got {value}")
    return value


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (repeatable); VALUE is read as TOML, else as a string. "
        "--set 'faults=[]' drops the [[faults]], e.g. --set 'faults=[]' --set "
        "worker.train_iters=50 for a short run (a fault past the last step is an error)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "validate":
            return cmd_validate(args)
        if args.command == "tail":
            return cmd_tail(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command in ("report", "experiment"):
            from supervisor.commands import report_cli

            return report_cli.main(args)
    except config_mod.ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        return interrupted_code(args.command)
    except BrokenPipeError:  # `… | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return ExitCode.DONE
    return ExitCode.USAGE


def interrupted_code(command: str) -> int:
    """Ctrl-C: a job's graceful stop is INTERRUPTED; following events ends as asked; a command
    that starts nothing ends as any shell command does."""
    if command in ("run", "experiment"):
        return ExitCode.INTERRUPTED
    return ExitCode.DONE if command == "tail" else INTERRUPTED_BY_USER


def cmd_validate(args: argparse.Namespace) -> int:
    raw = config_mod.parse_toml_file(args.config)
    if isinstance(raw.get("experiment"), dict):
        from supervisor.commands import experiment

        return experiment.cmd_validate(args)
    cfg = config_mod.load(args.config, args.set)
    r = job_mod.resolve(cfg)
    notes = preflight.check(r)
    print(f"{args.config}: ok ({r.summary()})")
    for note in notes:
        print(f"note: {note}")
    return ExitCode.DONE


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.set)
    r = job_mod.resolve(cfg)
    for note in preflight.check(r):
        print(f"note: {note}", file=sys.stderr)
    if args.dry_run:
        print(r.dry_run_text(args.config), end="")
        return ExitCode.DONE
    console.guard()  # a closed terminal (SIGHUP, then EIO) must not end the job's graceful stop
    job = job_mod.Job(r, console=None if args.quiet else sys.stderr)
    held = ownership.claim(r.run_dir, cfg.worker.flags.get("ckpt_dir"), job.job_id, cfg.job.name)
    try:
        code = int(asyncio.run(job.run()))
    finally:
        for fd in held:
            os.close(fd)
    if job.events_failing:
        print(
            f"events: {r.run_dir / 'events.jsonl'} is incomplete ({job.events_failing}); "
            f"the job ended with exit {code}",
            file=sys.stderr,
        )
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(
            sig, signal.SIG_IGN
        )  # the job is over: a late signal must not change the code
    if code == ExitCode.USAGE:  # the worker refused its input: nothing ran to report on
        if args.quiet:  # the console showed no events, so neither the worker's own line
            print(_worker_error(r.run_dir), file=sys.stderr)
        print(f"run dir: {r.run_dir}", file=sys.stderr)
        return code
    if not args.no_report and (r.run_dir / "events.jsonl").is_file():
        from supervisor.commands import report_cli

        report_cli.end_of_run(r.run_dir)  # report.md + report.png, tables on stdout
    return code


def _worker_error(run_dir: Path) -> str:
    """The worker's own one-line error from the newest attempt's output."""
    logs = sorted((run_dir / "attempts").glob("*/output.log"))
    lines = logs[-1].read_text(errors="replace").splitlines() if logs else []
    said = [line.split("] ", 1)[-1] for line in lines if "error" in line]
    return said[-1] if said else "error: the worker rejected its input (exit 2)"


def _add_report_commands(sub, fmt) -> None:
    rep = sub.add_parser(
        "report",
        help="what each failure cost",
        epilog=exit_codes_text("report"),
        formatter_class=fmt,
        description="From RUN_DIR's events and metrics: per failure (detection, lost steps, "
        "restart, downtime), totals and goodput, checkpoint stalls, the Young/Daly interval; "
        "writes report.md and report.png (into --out, default RUN_DIR) and prints the tables.",
    )
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.add_argument("--baseline", metavar="RUN_DIR", help="a run without failures to compare")
    rep.add_argument("--out", metavar="DIR", help="where report.md/png go (default RUN_DIR)")
    rep.add_argument("--no-plot", action="store_true", help="report.md only (no matplotlib)")
    exp = sub.add_parser(
        "experiment",
        help="baseline, sync and async phases under one fault schedule",
        epilog=exit_codes_text("experiment"),
        formatter_class=fmt,
        description="The checkpoint-restart study as one command: runs CONFIG's phases "
        "(baseline: no faults, no checkpoints; sync; async: the same [[faults]] and seed) one "
        "after another, each its own run dir under the experiment dir, then one comparison "
        "report (comparison.md, comparison.png).",
    )
    exp.add_argument("config", metavar="CONFIG", help="an experiment TOML (configs/experiments/)")
    _add_set(exp)
    exp.add_argument("--phases", help="comma-separated subset, e.g. baseline,sync")
    exp.add_argument(
        "--dry-run",
        action="store_true",
        help="check every phase, print each one's resolved config and launch command; start "
        "nothing",
    )
    exp.add_argument("--quiet", action="store_true", help="no events on the console")


# --- tail / status --------------------------------------------------------------------------------
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

    def take(self, event: dict) -> bool:
        """Note the event (the start it counts from, its kind); whether it is shown."""
        kind = str(event.get("event"))
        self.kinds.add(kind)
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
    path, missing = _events_path(args.run_dir)
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
    if not view.take(event):
        return ""
    if raw:
        return line.decode().strip()
    return "\n".join(map(_capped, events_mod.render(event, t0=view.t0).split("\n")))


TAIL_LINE_MAX = 4000  # characters of one printed line; a hand-edited 50 MB value is not shown


def _capped(text: str) -> str:
    if len(text) <= TAIL_LINE_MAX:
        return text
    more = len(text) - TAIL_LINE_MAX
    return f"{text[:TAIL_LINE_MAX]}… ({more} more characters; --json shows the line whole)"


def _events_path(run_dir: str) -> tuple[Path, str | None]:
    try:
        return events_mod.run_dir_events(run_dir)
    except ValueError as exc:
        raise config_mod.ConfigError(run_dir, "", str(exc)) from None


def cmd_status(args: argparse.Namespace) -> int:
    path, missing = _events_path(args.run_dir)
    run_dir = Path(args.run_dir)
    read = events_mod.load_events(path)
    events = read.events
    for note in (missing, read.note()):
        if note:
            print(f"note: {note}")
    try:
        resolved = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        resolved = {}
    resolved = {k: v for k, v in resolved.items() if isinstance(v, dict)}  # tables only
    for line in status_lines(events, resolved, run_dir):
        print(line)
    return ExitCode.DONE


def status_lines(events: list[dict], resolved: dict, run_dir: Path) -> list[str]:
    """The status report (pure over the events and the resolved config, plus a ckpt scan)."""
    starts = [e for e in events if e.get("event") == "start"]
    # An attempt starts cold (`launch`) or as a standby told to go (`standby_go`).
    launches = [e for e in events if e.get("event") in ("launch", "standby_go")]
    ends = [e for e in events if e.get("event") == "supervisor_exit"]
    max_restarts = resolved.get("restart", {}).get("max_restarts")
    max_restarts = max_restarts if isinstance(max_restarts, int) else None
    restarts = sum(1 for e in events if e.get("event") == "relaunch")
    last_start = starts[-1] if starts else {}
    name = resolved.get("job", {}).get("name", "?")
    holder = locks.lock_holder(run_dir)  # the supervisor that owns the run dir now
    if holder is not None:
        state = f"running (supervisor pid {holder.get('pid')} on {holder.get('host')})"
    elif ends and (not starts or ends[-1].get("ts", 0) >= last_start.get("ts", 0)):
        end = ends[-1]
        state = f"finished: {end.get('code_name')} (exit {end.get('code')}): {end.get('reason')}"
    elif last_start and _alive(last_start.get("pid")):
        state = f"running (supervisor pid {last_start.get('pid')})"
    elif last_start:
        state = "ended without a final event (the supervisor was killed?)"
    elif events or any((run_dir / "attempts").glob("[0-9]*")):
        state = "not running (the events that would say how it ended are lost)"
    else:
        state = "not started"
    out = [f"run:      {run_dir}", f"job:      {name}", f"state:    {state}"]
    reopened = sum(1 for e in events if e.get("event") == "events_reopened")
    if reopened:
        out.append(f"events:   events.jsonl was recreated {reopened} time(s): earlier events lost")
    left = "?" if max_restarts is None else max(0, max_restarts - restarts)
    out.append(f"attempts: {len(launches)}   restarts: {restarts} of {max_restarts} (left {left})")
    out += nodes_lines(events)
    ckpt_step, ckpt = _newest_checkpoint(resolved, events)
    step = step_line(steps_seen(events, run_dir), ckpt_step)
    if step:
        out.append(f"step:     {step}")
    out.append(f"checkpoint: {ckpt}")
    out += limits_lines(events, resolved)
    # A graceful stop (the user's SIGINT/SIGTERM) is no failure.
    failures = [
        e
        for e in events
        if e.get("event") == "attempt_end" and e.get("outcome") not in ("success", "stopped")
    ]
    if failures:
        f = failures[-1]
        source = f" ({f['resume_source']})" if isinstance(f.get("resume_source"), str) else ""
        out.append(
            f"last failure: attempt {f.get('attempt')}: {f.get('detail')} "
            f"(detected by {f.get('detected_by')}; resumed from {f.get('resume_step')}{source}, "
            f"reached {f.get('max_step')})"
        )
        out += stacks_lines(events, f.get("attempt"))
    else:
        out.append("last failure: none")
    return out


def nodes_lines(events: list[dict]) -> list[str]:
    """`nodes: active …; spares …; excluded n1 (2 failures)`, from the newest start and the node
    events after it; nothing for a job that never had more than one node, a spare or one out."""
    from supervisor.reporting.report import (
        pool_now,  # not for `run`: it reads no report until the end
    )

    pool = pool_now(events)
    if pool is None:
        return []
    active, spares, excluded = pool
    if len(active) <= 1 and not spares and not excluded:
        return []
    out = [f"{n} ({c} failure{'' if c == 1 else 's'})" if c else n for n, c in excluded.items()]
    return [
        f"nodes:    active {', '.join(active) or 'none'}; spares {', '.join(spares) or 'none'}; "
        f"excluded {', '.join(out) or 'none'}"
    ]


def limits_lines(events: list[dict], resolved: dict) -> list[str]:
    """The "auto" limits in force in the newest attempt: learned (`auto_limit` events), or
    still at their maximum. Nothing when the config has none."""
    hb = resolved.get("heartbeat", {})
    progress, cap = hb.get("progress", {}), hb.get("auto_max", {})
    progress = progress if isinstance(progress, dict) else {}
    defaults = config_mod.AutoMaxConfig()
    asked = [("timeout_s", hb.get("timeout_s"))] + [(p, progress.get(p)) for p in ("train", "save")]
    names = [name for name, value in asked if value == config_mod.AUTO]
    if not names:
        return []
    launches = [e for e in events if e.get("event") in ("launch", "standby_go")]
    newest = launches[-1].get("attempt") if launches else None
    learned = {
        e.get("limit"): e
        for e in events
        if e.get("event") == "auto_limit" and e.get("attempt") == newest and newest is not None
    }
    out = []
    for name in names:
        e = learned.get(name)
        if e is None:
            most = cap.get(name, getattr(defaults, name)) if isinstance(cap, dict) else None
            shown = f"{most:g}" if isinstance(most, (int, float)) else "?"
            out.append(f"{name} {shown} s (auto: its maximum until learned)")
            continue
        basis = ", ".join(
            f"{k} {e[k]:g}" for k in ("p99_step_s", "p99_beat_gap_s", "longest_save_s", "samples")
            if isinstance(e.get(k), (int, float))
        )  # fmt: skip
        where = "while training" if name == "timeout_s" else f"phase {name}"
        seconds = e.get("seconds")
        shown = f"{seconds:g}" if isinstance(seconds, (int, float)) else "?"
        out.append(f"{name} {shown} s (auto, {where}; from {basis})")
    return [("limits:   " if i == 0 else "          ") + line for i, line in enumerate(out)]


def stacks_lines(events: list[dict], attempt: object) -> list[str]:
    """The stacks a hang or no progress of `attempt` left (where, and a line per rank)."""
    found = [
        e
        for e in events
        if e.get("event") in ("hang", "no_progress") and e.get("attempt") == attempt
    ]
    if not found or "stacks_dir" not in found[-1]:
        return []
    e = found[-1]
    out = [f"  stacks: {e['stacks_dir']}"]
    if e.get("stacks_error"):
        out.append(f"    not collected: {e['stacks_error']}")
    lines = e.get("stacks")
    if isinstance(lines, list):
        out += [f"    {line}" for line in lines if isinstance(line, str)]
    return out


def steps_seen(events: list[dict], run_dir: Path) -> dict[int, int]:
    """The newest step each attempt is known to have reached: from any event that names a step
    (`attempt_end`'s max_step too) and the last record of each of its metrics files (one a
    step: progress events come seconds apart, and a standby's newer attempt has none yet)."""
    seen: dict[int, int] = {}

    def saw(attempt: object, step: object) -> None:
        if isinstance(attempt, int) and isinstance(step, int) and not isinstance(step, bool):
            seen[attempt] = max(step, seen.get(attempt, step))

    for e in events:
        saw(e.get("attempt"), e.get("step"))
        if e.get("event") == "attempt_end":
            saw(e.get("attempt"), e.get("max_step"))
    for adir in (run_dir / "attempts").glob("[0-9]*"):
        # Rank 0 steps with every rank; the others' files (--metrics-all-ranks: one a rank)
        # are read only when it has none.
        files = [adir / "metrics-0.jsonl"] if (adir / "metrics-0.jsonl").is_file() else []
        for path in files or adir.glob("metrics-*.jsonl"):
            if adir.name.isdigit():
                saw(int(adir.name), _last_metrics_record(path).get("step"))
    return seen


def step_line(seen: dict[int, int], ckpt_step: int | None) -> str | None:
    """`85 (attempt 3)`: the newest attempt that stepped and its newest step, never older than
    the newest complete checkpoint (the ranks resume from it), and what an earlier attempt
    reached beyond it (the steps a failure lost)."""
    if not seen:
        return None if ckpt_step is None else f"{ckpt_step} (the newest checkpoint)"
    attempt = max(seen)
    step = seen[attempt]
    if ckpt_step is not None and ckpt_step > step:
        return f"{ckpt_step} (the newest checkpoint; attempt {attempt} reached {step})"
    further = max(seen.values())
    if further > step:
        earlier = max(a for a, s in seen.items() if s == further)
        return f"{step} (attempt {attempt}; attempt {earlier} had reached {further})"
    return f"{step} (attempt {attempt})"


def _last_metrics_record(path: Path) -> dict:
    """The last whole JSON line of a metrics file (read from its end: it may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().split(b"\n")
    except OSError:
        return {}
    return next(events_mod.json_objects(reversed(lines)), {})


def _newest_checkpoint(resolved: dict, events: list[dict]) -> tuple[int | None, str]:
    """(step, how status shows it) of the newest complete checkpoint: from the checkpoint dir,
    else the `ckpt_complete` events."""
    ckpt_dir = resolved.get("worker", {}).get("ckpt_dir")
    if isinstance(ckpt_dir, str) and ckpt_dir and Path(ckpt_dir).is_dir():
        found = ckpt_files.resume_candidates(ckpt_files.scan(Path(ckpt_dir)))
        if found:
            return found[0].step, f"step {found[0].step} ({ckpt_dir}/{found[0].path.name})"
    marks = [e["step"] for e in events if e.get("event") == "ckpt_complete" and "step" in e]
    marks = [m for m in marks if isinstance(m, int)]
    return (max(marks), f"step {max(marks)} (from events)") if marks else (None, "none")


def _alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    import psutil

    return psutil.pid_exists(pid)


if __name__ == "__main__":
    sys.exit(main())
