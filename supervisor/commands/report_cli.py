"""`report` and `experiment`, and the report `run` prints at a job's end.

Kept out of cli.py so that `run`, `tail` and `status` import none of the analysis or matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contracts.exit_codes import ExitCode
from supervisor.reporting.load import NotARunDir


def main(args: argparse.Namespace) -> int:
    if args.command == "report":
        return cmd_report(args)
    from supervisor.commands import experiment

    return experiment.cmd_experiment(args)


def cmd_report(args: argparse.Namespace) -> int:
    from supervisor.reporting.report_md import write_report

    try:
        _, text, written = write_report(args.run_dir, args.baseline, args.out, png=not args.no_plot)
    except NotARunDir as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except OSError as exc:
        print(f"error: cannot write the report: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(text)
    print("wrote " + ", ".join(str(p) for p in written))
    return ExitCode.DONE


def end_of_run(run_dir: Path, png: bool = True) -> None:
    """The demo's last word: a short summary on stdout, report.md/png in the run dir. A report
    that cannot be made is one line on stderr, never a changed exit status."""
    from supervisor.reporting.report_md import write_report
    from supervisor.reporting.summary import summary

    try:
        analysis, _, written = write_report(run_dir, png=png)
    except Exception as exc:  # noqa: BLE001 - the job's outcome stands whatever the report does
        print(f"report: not written ({type(exc).__name__}: {exc})", file=sys.stderr)
        return
    print(summary(analysis, written), flush=True)
