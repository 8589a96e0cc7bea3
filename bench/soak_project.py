"""The project's side of `bench/soak.py`: `python -m supervisor run` on a generated config (the
debug preset on CPU, a durable save every 10 steps, everything else the defaults, plus the
user's `--set`), the trace as `[[faults]]` of its own fault engine, and what its events and
report analysis say of each failure.

The engine's `at_s` counts from the job's start, the trace from the first step: each fault is
put at the expected start-up (`startup_s`, the clean run's when it ran) plus its trace time,
and the row says when it really came after the first step. The engine waits, as the torchrun
side does, until the job trains again before the next failure.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import soak_run
from downtime_figures import records
from soak_run import Fired, Outcome
from soak_trace import Fault, Shape, project_faults
from vs_torchrun import env

from supervisor.log.events import read_events
from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from supervisor.settings import toml_dump

REPO = Path(__file__).resolve().parents[1]
WORKER = {"model": "debug", "device": "cpu", "save_interval": 10, "train_iters": 100000}
MAX_RESTARTS = 1000  # the default 10 would end a long trace's job (exit 3)
EMULATED = ("n0", "n1", "n2", "n3")
# A traced job whose first step comes further than this from the expected start-up is started
# again (its faults count from the job's start), at most TRIES times in all.
STARTUP_TOLERANCE_S = 1.0
TRIES = 3


def config(path: Path, run_dir: Path, shape: Shape, faults: list[dict], mem: Path) -> Path:
    """The job: `shape` on this host (emulated nodes when it has more than one)."""
    launch: dict = {"launcher": "mpiexec", "ranks_per_node": shape.ranks_per_node,
                    "env": {"OMP_NUM_THREADS": "1", "ES_MEM_ROOT": str(mem)}}  # fmt: skip
    if shape.nodes > 1:
        launch.update(emulate_nodes=True, nodes=list(EMULATED[: shape.nodes + shape.spares]),
                      spares=shape.spares)  # fmt: skip
    raw = {"job": {"name": "soak", "run_dir": str(run_dir)}, "launch": launch,
           "worker": dict(WORKER), "restart": {"max_restarts": MAX_RESTARTS}}  # fmt: skip
    if faults:
        raw["faults"] = faults
    path.write_text(toml_dump.dumps(raw))
    return path


def run(
    trace: list[Fault], *, shape: Shape, sets: list[str], duration_s: float,
    startup_s: float, tmp: Path,
) -> Outcome:  # fmt: skip
    """One window of the project; `trace` empty for the clean run. A traced job whose first
    step came more than STARTUP_TOLERANCE_S from `startup_s` after its start is stopped there
    and started again with the start-up it had (at most TRIES starts): its faults would land
    that much off their trace times."""
    result = Outcome("project", clean=not trace, world=shape.world, run_dir=tmp / "run")
    for tries in range(1, TRIES + 1):
        shutil.rmtree(result.run_dir, ignore_errors=True)
        last = not trace or tries == TRIES
        seen = window(trace, shape, sets, duration_s, startup_s, tmp, result, last)
        if seen is None:
            break
        result.notes.append(f"start-up {seen:.2f} s, not {startup_s:.2f}: started again")
        startup_s = seen
    evs = list(read_events(result.run_dir / "events.jsonl"))
    result.records = all_records(result.run_dir)
    result.fired = fired(trace, evs, result.t0 + duration_s)
    result.rows = failure_rows(result, evs, duration_s)
    result.skipped = [(e["attempt"], e["step"]) for e in evs if e["event"] == "numeric_fault"]
    resumed = {e["attempt"]: e["step"] for e in evs if e["event"] == "resumed"}  # one per rank
    result.resumes = sorted(resumed.items())
    ready = (e.get("cpu_s") for e in evs if e["event"] == "standby_ready")
    result.standby_cpu_s = [c for c in ready if c is not None]
    return result


def window(
    trace: list[Fault], shape: Shape, sets: list[str], duration_s: float, startup_s: float,
    tmp: Path, result: Outcome, last: bool,
) -> float | None:  # fmt: skip
    """The job from its start to the window's end (`result.t0`, `startup_s`, `ended` set);
    unless `last`, only to its first step when that came too far from `startup_s`: then the
    start-up it had."""
    mem, run_dir = soak_run.mem_root("proj"), result.run_dir
    cfg = config(tmp / "job.toml", run_dir, shape, project_faults(trace, startup_s), mem)
    cmd = [sys.executable, "-m", "supervisor", "run", str(cfg), "--quiet", "--no-report"]
    for s in sets:
        cmd += ["--set", s]
    with (tmp / "supervisor.log").open("a") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            first = soak_run.wait_first_step(lambda: all_records(run_dir), proc)
            start = next(e for e in read_events(run_dir / "events.jsonl")
                         if e["event"] == "start")  # fmt: skip
            result.t0, result.startup_s = first["t"], first["t"] - start["ts"]
            if not last and abs(result.startup_s - startup_s) > STARTUP_TOLERANCE_S:
                return result.startup_s
            result.ended = soak_run.sleep_until(result.t0 + duration_s + 1.0, proc)
            return None
        finally:
            soak_run.stop(proc)
            soak_run.drop_mem_root(mem)


def all_records(run_dir: Path) -> list[dict]:
    """Rank 0's records of every attempt, in attempt order, each with its attempt."""
    adirs = sorted(run_dir.glob("attempts/[0-9]*"))
    return [{**r, "attempt": int(a.name)} for a in adirs for r in records(run_dir, int(a.name))]


def fired(trace: list[Fault], evs: list[dict], end: float) -> list[Fired]:
    """Each trace failure's `fault` event, by name: when the engine gave it."""
    by_name = {e["name"]: e for e in evs if e["event"] == "fault"}
    out = []
    for f in trace:
        e = by_name.get(f.name)
        if e is not None and e["ts"] <= end:
            out.append(Fired(f, e["ts"], f"fault engine: {e['action']} {e['target']}"))
        else:
            out.append(Fired(f, None, "not given: the window ended first"))
    return out


def failure_rows(result: Outcome, evs: list[dict], duration_s: float) -> list[dict]:
    """Per failure given: the report analysis's row (detection, downtime, lost steps, relaunch
    mode, resume source), and failures in the window no fault of the trace caused, as kind
    `natural` (not the stop at its end)."""
    start = next(e for e in evs if e["event"] == "start")["ts"]  # the report's time 0
    stopped = next((e["ts"] for e in evs if e["event"] == "signal"), float("inf")) - start
    failures = [  # not those of the stop at the window's end: found after it
        f for f in analyze(load_run(result.run_dir)).failures
        if f.at_s + (f.detection_s or 0.0) < stopped
    ]  # fmt: skip
    rows = []
    for x in (x for x in result.fired if x.wall is not None):
        row = {"index": x.fault.index, "kind": x.fault.kind, "at_s": x.wall - result.t0,
               "relaunch": None, "source": None}  # fmt: skip
        f = next((f for f in failures if f.cause.startswith(f"fault {x.fault.name}:")), None)
        if f is not None:
            row.update(_figures(f))
        rows.append(row)
    for f in failures:
        at_s = start + f.at_s - result.t0
        if not f.fault and at_s <= duration_s:
            rows.append({"index": None, "kind": "natural", "at_s": at_s, **_figures(f)})
    return rows


def _figures(f) -> dict:
    return {
        "detection_s": f.detection_s,
        "downtime_s": f.downtime_s,
        "lost": f.lost_steps,
        "restart_s": f.restart_s,
        "relaunch": f.relaunch,
        "source": f.resumed_source,
    }
