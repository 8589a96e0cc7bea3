"""How soon a stall is found in the debug job: `[heartbeat.progress] train = "auto"` against a
fixed limit (the demo's 8 s), and whether either finds anything that was not injected.

Runs the real supervisor on configs/debug.toml (its model, ranks, saves and memory tier) with its
faults replaced by one: rank 0 stalls inside a step every `--every` steps (it keeps beating; only
the progress limit can find it). Per stall: the stall's `fault` event -> the `no_progress` finding
(`detected_mono`), the limit the finding names, and the learned limit (`auto_limit` events).
A finding with no stall before it in its attempt is a false one.

Usage: python bench/stall_detect.py [--modes auto,8] [--iters 200] [--every 60]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from supervisor.settings import toml_dump  # noqa: E402


def write_config(workdir: Path, mode: str, iters: int, every: int) -> Path:
    raw = tomllib.loads((REPO / "configs" / "debug.toml").read_text())
    raw["job"] = {"name": f"stall-{mode}", "run_dir": str(workdir / f"run-{mode}")}
    raw["worker"]["train_iters"] = iters
    raw["restart"]["backoff_s"] = [0]
    raw["restart"]["max_same_resume"] = 10
    raw["heartbeat"]["progress"]["train"] = "auto" if mode == "auto" else float(mode)
    raw["faults"] = [{"name": "stall", "every_steps": every, "action": "stall", "target": "rank:0"}]
    path = workdir / f"{mode}.toml"
    path.write_text(toml_dump.dumps(raw))
    return path


def measure(run: Path) -> dict:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    stalls, found, false, limits = [], [], [], []
    fault_at: dict[int, float] = {}
    for e in events:
        a = e.get("attempt")
        if e["event"] == "fault" and e.get("action") == "stall":
            fault_at[a] = e["mono"]
            stalls.append(e)
        elif e["event"] == "auto_limit" and e.get("limit") == "train":
            limits.append(e["seconds"])
        elif e["event"] in ("no_progress", "hang"):
            if a in fault_at and e["event"] == "no_progress":
                limit = re.search(r"\(timeout ([\d.]+) s(, auto)?\)", e["reason"])
                found.append(
                    {
                        "from_stall_s": e["detected_mono"] - fault_at.pop(a),
                        "past_deadline_s": e["latency_s"],
                        "limit_s": float(limit.group(1)) if limit else None,
                        "auto": bool(limit and limit.group(2)),
                        "step": e["step"],
                    }
                )
            else:
                false.append(e)
    done = any(e["event"] == "done" for e in events)
    return {"stalls": len(stalls), "found": found, "false": false, "limits": limits, "done": done}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="auto,8", help='"auto" and/or fixed limits in seconds')
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--every", type=int, default=60)
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="stall-detect-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for mode in args.modes.split(","):
        config = write_config(workdir, mode, args.iters, args.every)
        subprocess.run(
            [sys.executable, "-m", "supervisor", "run", str(config), "--quiet"],
            cwd=REPO, env=env, timeout=1800, check=False, capture_output=True,
        )  # fmt: skip
        got = measure(workdir / f"run-{mode}")
        lat = [f["from_stall_s"] for f in got["found"]]
        state = "done" if got["done"] else "NOT done"
        print(f"train = {mode}: {got['stalls']} stalls, {len(lat)} found by no_progress, "
              f"{len(got['false'])} false findings, job {state}")  # fmt: skip
        if lat:
            print(f"  stall -> finding: median {statistics.median(lat):.2f} s, "
                  f"min {min(lat):.2f} s, max {max(lat):.2f} s")  # fmt: skip
        for f in got["found"]:
            print(f"  step {f['step']}: {f['from_stall_s']:.2f} s (limit {f['limit_s']} s"
                  f"{', auto' if f['auto'] else ''}; {f['past_deadline_s'] * 1000:.0f} ms "
                  f"past it)")  # fmt: skip
        if got["limits"]:
            print(f"  learned train limits (auto_limit events): {got['limits']}")
        for e in got["false"]:
            print(f"  FALSE: attempt {e.get('attempt')} {e['event']}: {e.get('reason')}")
    print(f"runs: {workdir}")


if __name__ == "__main__":
    main()
