"""`python -m supervisor run|validate|tail|status|report|experiment`: the parser, the exit
codes each command lists, `run` and `validate`; `tail` and `status` live in their own modules,
`report` and `experiment` behind `report_cli`.

User errors (bad config, bad flags, a missing launcher) print one line and exit 2, without a
traceback. The supervisor never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from contracts.exit_codes import ExitCode
from supervisor.commands import continuing, preflight
from supervisor.commands.status import cmd_status
from supervisor.commands.tail import TAIL_HIDDEN, cmd_tail
from supervisor.host import ownership
from supervisor.launch.resolve import Resolved, resolve
from supervisor.log import console
from supervisor.policy.access import Access, access_for
from supervisor.run import job as job_mod
from supervisor.settings import config as config_mod
from supervisor.settings import loading

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
    "[restart] min_nodes), or the Slurm allocation gone",
    ExitCode.DIVERGED: "diverged: the ranks' numerical guard gave up (its line says what to "
    "change); not relaunched",
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
        description="Launch the job of CONFIG and keep it going until done; or continue a "
        "stopped, failed or given-up job in its run dir (--resume RUN_DIR, or CONFIG whose run "
        "dir holds it): the same job id, its checkpoints and memory copies, a new restart budget.",
    )
    run.add_argument(
        "config", metavar="CONFIG", nargs="?", help="the job's TOML file (with --resume: instead "
        "of the run dir's own config.toml)",
    )  # fmt: skip
    _add_set(run)
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the job of RUN_DIR with its own config.toml (or CONFIG), --set on top",
    )
    run.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="continue although KEY (e.g. worker.train_iters, or world) changed in a way that "
        "breaks a bit-exact resume (repeatable, or comma-separated); recorded in events",
    )
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
    raw = loading.parse_toml_file(args.config)
    if isinstance(raw.get("experiment"), dict):
        from supervisor.commands import experiment

        return experiment.cmd_validate(args)
    cfg = loading.load(args.config, args.set)
    resolved = resolve(cfg)
    notes = preflight.check(resolved)
    print(f"{args.config}: ok ({resolved.summary()})")
    for note in notes:
        print(f"note: {note}")
    return ExitCode.DONE


def cmd_run(args: argparse.Namespace) -> int:
    cfg = continuing.load(args)
    resolved = resolve(cfg)
    for note in preflight.check(resolved):
        print(f"note: {note}", file=sys.stderr)
    args.continues = continuing.check(resolved, args.resume is not None, args.allow_change)
    for line in args.continues.lines(resolved.run_dir) if args.continues else []:
        print(line, file=sys.stderr)
    if args.dry_run:
        print(resolved.dry_run_text(cfg.source), end="")
        return ExitCode.DONE
    console.guard()  # a closed terminal (SIGHUP, then EIO) must not end the job's graceful stop
    access = access_for(cfg.job.share_with_group)
    umask = os.umask(access.umask)  # all the job writes (its ranks here too): no one else's
    try:
        return _run(args, resolved, access)
    finally:
        os.umask(umask)


def _run(args: argparse.Namespace, resolved: Resolved, access: Access) -> int:
    """The job, from its directories to its report."""
    cfg = resolved.cfg
    continues = args.continues
    job = job_mod.Job(
        resolved,
        console=None if args.quiet else sys.stderr,
        job_id=continues.previous.job_id if continues else None,
        continued=continues.event() if continues else None,
    )
    held = ownership.claim(
        resolved.run_dir, cfg.worker.flags.get("ckpt_dir"), job.job_id, cfg.job.name, access
    )
    try:
        code = int(asyncio.run(job.run()))
    finally:
        for fd in held:
            os.close(fd)
    if job.events_failing:
        print(
            f"events: {resolved.run_dir / 'events.jsonl'} is incomplete ({job.events_failing}); "
            f"the job ended with exit {code}",
            file=sys.stderr,
        )
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(
            sig, signal.SIG_IGN
        )  # the job is over: a late signal must not change the code
    if code == ExitCode.USAGE:  # the worker refused its input: nothing ran to report on
        if args.quiet:  # the console showed no events, so neither the worker's own line
            print(_worker_error(resolved.run_dir), file=sys.stderr)
        print(f"run dir: {resolved.run_dir}", file=sys.stderr)
        return code
    if not args.no_report and (resolved.run_dir / "events.jsonl").is_file():
        from supervisor.commands import report_cli

        report_cli.end_of_run(resolved.run_dir)  # report.md + report.png, tables on stdout
    for line in continuing.hint_lines(resolved.run_dir):
        print(line, flush=True)  # exit 3, 4, 5, 6: the command that continues it
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


if __name__ == "__main__":
    sys.exit(main())
