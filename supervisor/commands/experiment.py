"""`python -m supervisor experiment CONFIG`: the checkpoint-restart study as one command.

CONFIG is a job config plus an `[experiment]` table. Its phases run one after another on the
same nodes, each a full supervised job in its own run dir under the experiment dir:

- `baseline`: no faults, no checkpoints (save_interval and mem_ckpt_interval 0, no save on
  exit);
- `sync`: the config's [[faults]] and checkpoints, synchronous saves;
- `async`: the same faults and seed, `--async-ckpt`.

Then every phase gets its report (against the baseline) and the experiment one comparison:
comparison.md and comparison.png in the experiment dir.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contracts.exit_codes import ExitCode
from supervisor.commands import preflight
from supervisor.host import ownership
from supervisor.log import console
from supervisor.policy.access import Access, access_for
from supervisor.settings import checks, loading
from supervisor.settings import config as config_mod

if TYPE_CHECKING:
    from supervisor.launch.resolve import Resolved

PHASES = ("baseline", "sync", "async")
EXPERIMENT_KEYS = ("name", "dir", "phases", *PHASES)


@dataclass
class Experiment:
    name: str
    dir: Path
    phases: list[str]
    base: dict[str, Any]  # the job config, without [experiment]
    overrides: dict[str, list[str]] = field(default_factory=dict)  # per phase, `key=value`
    source: str = "<experiment>"


def load(
    path: str, sets: list[str], only: str | None = None, now: float | None = None
) -> Experiment:
    """Read an experiment TOML; ConfigError (exit 2) for anything wrong, like `run`."""
    source = str(path)
    raw = loading.parse_toml_file(path)
    for item in sets:  # `--set experiment.dir=...` works too
        loading.apply_override(raw, item, source)
    exp = raw.pop("experiment", None)
    if not isinstance(exp, dict):
        raise config_mod.ConfigError(source, "experiment", "expected an [experiment] table")
    for key in exp:
        if key not in EXPERIMENT_KEYS:
            known = ", ".join(EXPERIMENT_KEYS)
            where = f"experiment.{key}"
            raise config_mod.ConfigError(source, where, f"unknown key; known: {known}")
    job = raw.get("job")
    name = exp.get("name", job.get("name", "experiment") if isinstance(job, dict) else "experiment")
    if not isinstance(name, str):
        raise config_mod.ConfigError(source, "experiment.name", f"expected a name, got {name!r}")
    # Each phase's job is named `<name>-<phase>`: the name is checked as a job name is, with
    # room for the longest phase.
    most = checks.NAME_MAX - len("-baseline")
    problem = checks.name_problem(name)
    if problem is None and len(name) > most:
        problem = f"expected at most {most} characters (a phase's job is <name>-baseline)"
    if problem:
        raise config_mod.ConfigError(source, "experiment.name", problem)
    phases = exp.get("phases", list(PHASES))
    if only:
        phases = [p.strip() for p in only.split(",") if p.strip()]
    if not isinstance(phases, list) or not phases or any(p not in PHASES for p in phases):
        raise config_mod.ConfigError(
            source, "experiment.phases", f"expected a non-empty list of {', '.join(PHASES)}"
        )
    overrides: dict[str, list[str]] = {}
    for p in PHASES:
        items = exp.get(p, [])
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise config_mod.ConfigError(source, f"experiment.{p}", 'expected ["key=value", ...]')
        overrides[p] = items
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    dir_text = exp.get("dir", "runs/{name}-{time}")
    if not isinstance(dir_text, str):
        raise config_mod.ConfigError(source, "experiment.dir", "expected a directory path")
    dir_text = config_mod.fill_dir(dir_text, source, "experiment.dir", name=name, time=stamp)
    directory = Path(dir_text).expanduser().absolute()
    e = Experiment(name, directory, phases, raw, overrides, source)
    for p in phases:  # every phase's config must be valid before the first one starts
        phase_config(e, p)
    return e


def phase_raw(e: Experiment, phase: str) -> dict[str, Any]:
    """The job config of one phase (pure): the base with the phase's changes."""
    raw = copy.deepcopy(e.base)
    job = raw.setdefault("job", {})
    job["name"] = f"{e.name}-{phase}"
    job["run_dir"] = str(e.dir / phase)
    worker = raw.setdefault("worker", {})
    ckpt_dir = worker.get("ckpt_dir")
    if not (isinstance(ckpt_dir, str) and "{run_dir}" in ckpt_dir):
        worker["ckpt_dir"] = "{run_dir}/ckpt"  # never resume from another phase's checkpoints
    if phase == "baseline":
        raw.pop("faults", None)
        worker["save_interval"] = 0
        worker["mem_ckpt_interval"] = 0  # the memory tier's default is "auto": on
        worker["save_on_exit"] = False
        worker.pop("async_ckpt", None)
    elif phase == "sync":
        worker.pop("async_ckpt", None)
    else:
        worker["async_ckpt"] = True
    for item in e.overrides.get(phase, []):
        loading.apply_override(raw, item, f"{e.source} [experiment.{phase}]")
    return raw


def phase_config(e: Experiment, phase: str) -> config_mod.Config:
    return loading.from_dict(phase_raw(e, phase), f"{e.source} ({phase})")


def resolve_phases(e: Experiment) -> tuple[dict[str, Resolved], list[str]]:
    """Every phase resolved and checked before the first one starts (a phase that cannot start
    would otherwise end the experiment after the earlier phases ran); the notes, once each."""
    from supervisor.launch.resolve import resolve

    phases: dict[str, Resolved] = {}
    notes: list[str] = []
    for phase in e.phases:
        resolved = resolve(phase_config(e, phase))
        notes += [n for n in preflight.check(resolved) if n not in notes]
        phases[phase] = resolved
    return phases, notes


def cmd_validate(args: argparse.Namespace) -> int:
    """`validate` of an experiment config: its [experiment] table and every phase's job."""
    e = load(args.config, args.set)
    phases, notes = resolve_phases(e)
    first = next(iter(phases.values()))
    print(
        f"{args.config}: ok (experiment {e.name}: phases {', '.join(e.phases)}; {first.summary()})"
    )
    for note in notes:
        print(f"note: {note}")
    return ExitCode.DONE


def cmd_experiment(args: argparse.Namespace) -> int:
    e = load(args.config, args.set, args.phases)
    phases, notes = resolve_phases(e)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.dry_run:
        print(f"# experiment {e.name}: phases {', '.join(e.phases)} in {e.dir}")
        for phase, resolved in phases.items():
            print(f"\n# === phase {phase}")
            print(resolved.dry_run_text(f"{args.config}, phase {phase}"), end="")
        return ExitCode.DONE
    first = next(iter(phases.values()))  # the experiment's dir is as the first phase's run dir
    access = access_for(first.cfg.job.share_with_group)
    umask = os.umask(access.umask)  # all the phases write: no one else's
    try:
        return _run(args, e, phases, access)
    finally:
        os.umask(umask)


def _run(
    args: argparse.Namespace, e: Experiment, phases: dict[str, Resolved], access: Access
) -> int:
    """Each phase in turn, then the comparison."""
    from supervisor.run import job as job_mod

    try:
        ownership.make_dir(e.dir, access)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise config_mod.ConfigError(
            str(e.dir), "", f"cannot be made ({why}); choose another directory"
        ) from None
    console.guard()  # a closed terminal (SIGHUP, then EIO) must not end a graceful stop
    print(f"experiment {e.name}: phases {', '.join(e.phases)} in {e.dir}", flush=True)
    codes: dict[str, int] = {}
    for phase, resolved in phases.items():
        cfg = resolved.cfg
        print(f"=== phase {phase}: {resolved.run_dir}", flush=True)
        job = job_mod.Job(resolved, console=None if args.quiet else sys.stderr)
        ckpt_dir = cfg.worker.flags.get("ckpt_dir")
        held = ownership.claim(resolved.run_dir, ckpt_dir, job.job_id, cfg.job.name, access)
        try:
            codes[phase] = int(asyncio.run(job.run()))
        finally:
            for fd in held:
                os.close(fd)
        print(f"=== phase {phase}: exit {codes[phase]} ({ExitCode(codes[phase]).name})", flush=True)
        if codes[phase] in (ExitCode.INTERRUPTED, ExitCode.USAGE):
            break
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the runs are over: reports only
        signal.signal(sig, signal.SIG_IGN)
    text = write_comparison(e, codes)
    print(text, flush=True)
    print(f"wrote {e.dir / 'comparison.md'}, {e.dir / 'comparison.png'}", flush=True)
    return next((c for c in codes.values() if c != 0), ExitCode.DONE)


def write_comparison(e: Experiment, codes: dict[str, int]) -> str:
    """Each phase's report (against the baseline), then comparison.md and comparison.png."""
    from supervisor.reporting.plot import plot_comparison
    from supervisor.reporting.report_md import comparison, write_report

    runs = {p: e.dir / p for p in codes if (e.dir / p / "events.jsonl").is_file()}
    base = runs.get("baseline")
    analyses = {}
    for phase, run in runs.items():
        analyses[phase], _, _ = write_report(run, base if phase != "baseline" else None)
    text = comparison(e.name, analyses, codes)
    (e.dir / "comparison.md").write_text(text)
    if analyses:
        plot_comparison(analyses, e.dir / "comparison.png", e.name)
    return text
