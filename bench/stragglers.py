"""Stragglers found and acted on (issue 28): false alarms, time to name a slow rank, and the job
going on on a spare, bit-exact.

One invocation, three jobs under `python -m supervisor run` on emulated nodes (real mpiexec,
real ranks and collectives), 4 nodes x 1 rank, the tiny model of the tests, `[stragglers]` at
its defaults:

  healthy  HEALTHY_STEPS steps, no fault: straggler events over them (0 wanted), the healthy
           step time (rank 0's median `train/dt`), and the margin: every rank's metrics replayed
           through the same score, step by step, the highest window median any rank reached
           (against the threshold)
  plain    REPLACE_STEPS steps, no fault: the uninterrupted run's losses
  replace  REPLACE_STEPS steps, 1 spare, `action = "replace"`: a `slow` fault at SLOW_AT makes
           rank 2 (node n2) sleep half the healthy step in every step; the event must name rank
           2 and n2 within 30 steps of the fault; the ranks stop at the next durable checkpoint
           and the spare n4 takes n2's place; the job must finish there with every loss equal to
           the plain run's, bit for bit

The last line is JSON.

Usage: python bench/stragglers.py [--healthy-steps 1000] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from downtime_figures import records  # noqa: E402

from supervisor.log.events import read_events  # noqa: E402
from supervisor.policy.stragglers import scores, window_score  # noqa: E402
from supervisor.settings import toml_dump  # noqa: E402
from supervisor.settings.config import StragglersConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": "debug", "device": "cpu", "dim": 32, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": 2, "ffn_dim": 64, "vocab_size": 128, "seq_len": 32,
        "batch_size": 2}  # fmt: skip
HEALTHY_STEPS = 1000
REPLACE_STEPS = 80
SAVE_EVERY = 10
SLOW_AT = 20
NAMED_WITHIN = 30


def config(
    path: Path, run: Path, steps: int, spare: bool, slow_s: float | None, interval_s: float
) -> Path:
    nodes = [f"n{i}" for i in range(5 if spare else 4)]
    raw = {
        "job": {"name": "stragglers", "run_dir": str(run)},
        "launch": {
            "launcher": "mpiexec", "emulate_nodes": True, "ranks_per_node": 1, "nodes": nodes,
            "spares": 1 if spare else 0, "env": {"OMP_NUM_THREADS": "1"},
        },
        "worker": {
            **TINY, "train_iters": steps, "save_interval": SAVE_EVERY,
            "metrics_all_ranks": not spare,
        },
        "restart": {"backoff_s": [0], "standby": False},
        "heartbeat": {"interval_s": interval_s, "timeout_s": max(10.0, 4 * interval_s)},
        "stragglers": {"action": "replace" if slow_s else "report"},
    }  # fmt: skip
    if slow_s:
        raw["faults"] = [{
            "name": "slow-rank2", "at_step": SLOW_AT, "action": "slow", "target": "rank:2",
            "delay_s": round(slow_s, 4), "duration_s": 3600,
        }]  # fmt: skip
    path.write_text(toml_dump.dumps(raw))
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


def losses(run: Path) -> dict[int, float]:
    """step -> rank 0's loss, the newest attempt's record of a step winning."""
    out: dict[int, float] = {}
    for adir in sorted((run / "attempts").iterdir()):
        for r in records(run, int(adir.name)):
            out[r["step"]] = r["loss"]
    return out


def peak_score(run: Path, window: int) -> float:
    """The highest window median of any rank's score, replayed from every rank's metrics of
    the first attempt, one observation a step."""
    adir = run / "attempts" / "000"
    by_rank = {}
    for path in adir.glob("metrics-*.jsonl"):
        rank = int(path.stem.split("-")[1])
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        by_rank[rank] = {r["step"]: r["train/compute_seconds"] for r in recs}
    steps = sorted(set.intersection(*(set(v) for v in by_rank.values())))
    history: dict[int, list[float]] = {r: [] for r in by_rank}
    peak = 0.0
    for step in steps:
        for rank, score in scores({r: v[step] for r, v in by_rank.items()}).items():
            history[rank].append(score)
            over = window_score(history[rank], window)
            peak = max(peak, over or 0.0)
    return peak


def of(run: Path, name: str) -> list[dict]:
    return [e for e in read_events(run / "events.jsonl") if e["event"] == name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--healthy-steps", type=int, default=HEALTHY_STEPS)
    parser.add_argument("--keep", action="store_true", help="keep the run dirs")
    parser.add_argument(
        "--interval-s", type=float, default=1.0, help="the heartbeat interval (the default's)"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="es-bench-stragglers-"))
    try:
        healthy = tmp / "healthy"
        beat = args.interval_s
        wall = run_job(config(tmp / "healthy.toml", healthy, args.healthy_steps, False, None, beat))
        step_s = statistics.median(r["train/dt"] for r in records(healthy, 0)[3:])
        false_alarms = len(of(healthy, "straggler"))
        defaults = StragglersConfig()
        peak = peak_score(healthy, defaults.window)
        print(f"healthy: {args.healthy_steps} steps in {wall:.0f} s, step {step_s * 1000:.0f} ms,"
              f" {false_alarms} straggler event(s), peak window score {peak:.2f}"
              f" (threshold {defaults.threshold})", flush=True)  # fmt: skip
        plain = tmp / "plain"
        run_job(config(tmp / "plain.toml", plain, REPLACE_STEPS, False, None, beat))
        slow = tmp / "replace"
        run_job(config(tmp / "replace.toml", slow, REPLACE_STEPS, True, step_s / 2, beat))
        (fault,) = of(slow, "fault")
        found = of(slow, "straggler")
        first = found[0] if found else {}
        named = (first.get("ranks"), first.get("node")) == ([2], "n2")
        steps_to_event = first["step"] - fault["step"] if first else None
        swapped = [(e["out"], e["into"]) for e in of(slow, "node_swapped")]
        last_nodes = of(slow, "launch")[-1]["nodes"]
        same = losses(slow) == losses(plain) and len(losses(plain)) == REPLACE_STEPS
        figures = {
            "interval_s": beat,
            "healthy_steps": args.healthy_steps,
            "healthy_step_ms": round(step_s * 1000, 1),
            "false_alarms": false_alarms,
            "healthy_peak_score": round(peak, 3),
            "threshold": defaults.threshold,
            "slow_delay_ms": round(step_s / 2 * 1000, 1),
            "steps_to_event": steps_to_event,
            "window_steps": [first.get("since_step"), first.get("step")],
            "named_right": named,
            "score": first.get("score"),
            "events": len(found),
            "swapped": swapped,
            "finished_on": last_nodes,
            "done": bool(of(slow, "done")),
            "bit_exact": same,
            "ok": false_alarms == 0
            and named
            and steps_to_event is not None
            and steps_to_event <= NAMED_WITHIN
            and swapped == [("n2", "n4")]
            and same,
        }
        print(json.dumps(figures), flush=True)
    finally:
        if args.keep:
            print(f"kept: {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
