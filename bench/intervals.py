"""Checkpoint intervals that tune themselves (issue 35, item 4): `save_interval = "auto"` against
the best fixed interval for the same run, the failure rate changed 10x halfway.

One invocation, one job per interval under `python -m supervisor run` (real mpiexec, 2 ranks, the
tiny model of the tests, the warm standby), the memory tier off so that durable saves alone serve
each resume. Every job gets the same kills of rank 1 at the same steps (`at_step`: the same
training progress, whatever the interval): gaps of about DENSE_GAP steps in the first half of
the run, ten times longer in the second (seeded exponential gaps). One job per fixed
`save_interval` in --fixed, one with `save_interval = "auto"` per `mtbf_prior_s` in --priors
(a prior far from the run's failure rate costs the failures before the first one is seen).

Waste of a job, what the interval decides: the loop's stall in saves (every attempt's
`train/ckpt_save_seconds`) plus the steps each failure threw away (the report's lost steps) times
the job's median step. The relaunches cost the same in every job and are left out. On a shared
host a save's and a step's seconds differ from one job to the next (0.07 against 0.12 s a save
was seen), so each job's saves and lost steps are also priced alike: at the median save and the
median step of all the jobs together (`priced_s`). The best fixed interval is the fixed job that
wasted least; the figures are auto's waste over it, as measured and as priced alike.

The last line is JSON.

Usage: python bench/intervals.py [--steps 1000] [--fixed 10,15,20,30,45] [--priors 60,10]
                                 [--seed 0] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.log.events import read_events  # noqa: E402
from supervisor.reporting.analysis import analyze  # noqa: E402
from supervisor.reporting.load import load_run  # noqa: E402
from supervisor.settings import toml_dump  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": "debug", "device": "cpu", "dim": 32, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "ffn_dim": 64, "vocab_size": 128, "seq_len": 32,
        "batch_size": 2}  # fmt: skip
DENSE_GAP = 25  # steps between kills, on average, in the first half
SAVES: list[float] = []  # every job's save seconds, to price them alike
STEPS: list[float] = []  # every job's step seconds


def kill_steps(steps: int, seed: int) -> list[int]:
    """Seeded kill points: exponential gaps of DENSE_GAP steps in the first half, 10x in the
    second; at least 3 steps apart, none in the last 5 steps."""
    rng, out, at = random.Random(seed), [], 0.0
    while True:
        gap = DENSE_GAP if at < steps / 2 else 10 * DENSE_GAP
        at += max(3.0, rng.expovariate(1 / gap))
        if at >= steps - 5:
            return out
        out.append(int(at))


def config(path: Path, run: Path, steps: int, every: int | str, kills: list[int], prior: float):
    table = {
        "job": {"name": "iv", "run_dir": str(run)},
        "launch": {"launcher": "mpiexec", "ranks_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}},
        "worker": {**TINY, "train_iters": steps, "save_interval": every, "mem_ckpt_interval": 0,
                   "mtbf_prior_s": prior, "log_every": 100},
        "restart": {"max_restarts": len(kills) + 2, "backoff_s": [0.0], "teardown_grace_s": 1.0,
                    "max_same_resume": len(kills) + 2},
        "heartbeat": {"interval_s": 0.25, "timeout_s": 3.0},
        "faults": [{"at_step": kills, "action": "kill", "target": "rank:1"}],
    }  # fmt: skip
    path.write_text(toml_dump.dumps(table))
    return path


def run_job(cfg: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "supervisor", "run", str(cfg), "--quiet", "--no-report"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"the job failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    return time.monotonic() - t0


def waste(run: Path) -> dict:
    """What the interval cost this job: saves' stall and the steps redone (seconds)."""
    data = load_run(run)
    a = analyze(data)
    step_s = statistics.median(r.dt for r in data.records)
    SAVES.extend(s.save_s for s in a.checkpoints.saves if s.save_s is not None)
    STEPS.extend(r.dt for r in data.records)
    saves_s = sum(s.save_s or 0.0 for s in a.checkpoints.saves)
    lost = a.totals.lost_steps
    changed = [e for e in read_events(run / "events.jsonl") if e.get("event") == "interval_changed"]
    return {
        "saves": len(a.checkpoints.saves),
        "saves_s": round(saves_s, 3),
        "lost_steps": lost,
        "step_s": round(step_s, 4),
        "redone_s": round(lost * step_s, 3),
        "waste_s": round(saves_s + lost * step_s, 3),
        "failures": a.totals.failures,
        "intervals": [e["new"] for e in changed],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--fixed", default="10,15,20,30,45", help="fixed save_interval values")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--priors", default="60,10", help="auto's mtbf_prior_s, one job each")
    p.add_argument("--keep", action="store_true", help="keep the run dirs")
    a = p.parse_args()
    kills = kill_steps(a.steps, a.seed)
    print(f"kills of rank 1 at steps {kills}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="es-intervals-"))
    rows = {}
    try:
        jobs = [(int(x), 0.0) for x in a.fixed.split(",")]
        jobs += [("auto", float(x)) for x in a.priors.split(",")]
        for every, prior in jobs:
            name = f"auto-{prior:g}" if every == "auto" else str(every)
            run = work / f"run-{name}"
            seconds = run_job(
                config(work / f"{name}.toml", run, a.steps, every, kills, prior or 3600.0)
            )
            rows[name] = {**waste(run), "wall_s": round(seconds, 1)}
            print(f"save_interval {name}: {json.dumps(rows[name])}", flush=True)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    save_s, step_s = statistics.median(SAVES), statistics.median(STEPS)
    for row in rows.values():
        row["priced_s"] = round(row["saves"] * save_s + row["lost_steps"] * step_s, 3)
    out = {"kills": kills, "save_s": round(save_s, 4), "step_s": round(step_s, 4), "rows": rows}
    fixed = {k: v for k, v in rows.items() if not k.startswith("auto")}
    for key in ("waste_s", "priced_s"):
        best = min(fixed, key=lambda k: fixed[k][key])
        out[key] = {"best_fixed": best}
        for auto in (k for k in rows if k.startswith("auto")):
            ratio = rows[auto][key] / fixed[best][key]
            print(f"{key}: best fixed save_interval {best} ({fixed[best][key]} s); {auto} "
                  f"{rows[auto][key]} s = {ratio:.2f}x")  # fmt: skip
            out[key][auto] = round(ratio, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
