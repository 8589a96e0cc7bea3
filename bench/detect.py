"""Detection latency of the supervisor, by path: launcher exit, liveness loss, progress loss.

Runs the real supervisor (`python -m supervisor run`) on 2 light ranks that use the real Beacon
but no torch, so that what is timed is the supervisor, not a model's start-up:

- exit:       rank 1 exits with code 1 after its 3rd step; latency = teardown start - the moment
              waitpid returned (the `teardown` event's latency_s; `local` only: under Hydra the
              launcher outlives a rank's plain exit and the supervisor's pid check of the ranks
              on its host sees it); also the rank's own record of its exit -> teardown start.
- liveness:   rank 1 stops itself (SIGSTOP); latency = detection - (last beat + timeout_s), and
              detection - the stop.
- progress:   rank 1 keeps beating but stops stepping; latency = detection - (last step +
              the train phase timeout).

Each scenario runs `--attempts` attempts (relaunches) and reports the median and max.
Usage: python bench/detect.py [--attempts 5] [--launcher local|mpiexec]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    from worker.beat import Beacon

    rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK"))
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE"))
    mode = os.environ["BENCH_MODE"]
    marks = os.path.join(os.environ["ES_ATTEMPT_DIR"], f"marks-{rank}.json")
    b = Beacon.from_env(rank, world)
    b.hello("init")
    b.phase("train", 0)
    for step in range(1, 10_000):
        time.sleep(0.1)
        b.step(step, 1.0, 0.1)
        if rank == 1 and step == 3:
            time.sleep(0.05)  # let the step message leave
            with open(marks, "w") as f:
                f.write(str(time.monotonic()))
            if mode == "exit":
                os._exit(1)
            if mode == "liveness":
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "progress":
                while True:
                    time.sleep(1)
    """
)


def run_scenario(mode: str, attempts: int, launcher: str, workdir: Path) -> dict:
    run = workdir / f"run-{mode}"
    config = workdir / f"{mode}.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [job]
            name = "detect-{mode}"
            run_dir = "{run}"
            [launch]
            launcher = "{launcher}"
            ranks_per_node = 2
            cwd = "{workdir}"
            env = {{ BENCH_MODE = "{mode}", PYTHONPATH = "{REPO}" }}
            [worker]
            module = "bench_rank"
            [restart]
            max_restarts = {attempts - 1}
            backoff_s = [0]
            max_same_resume = {attempts + 1}
            teardown_grace_s = 0.5
            [heartbeat]
            interval_s = 0.5
            timeout_s = 2.0
            check_s = 0.1
            [heartbeat.progress]
            train = 2.0
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(config), "--quiet"],
        cwd=REPO, env=env, timeout=60 + 20 * attempts, check=False,
    )  # fmt: skip
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    out: dict[str, list[float]] = {"latency_s": [], "from_fault_s": [], "teardown_s": []}
    for a in range(attempts):
        mark_file = run / "attempts" / f"{a:03d}" / "marks-1.json"
        fault = float(mark_file.read_text()) if mark_file.exists() else None
        by = {e["event"]: e for e in events if e.get("attempt") == a}
        if mode == "exit":
            # Under `local` the supervisor reaps the rank itself (an `exit` event); under Hydra a
            # rank's plain non-zero exit does not end mpiexec, and the pid check sees it
            # (`rank_exit`). Either way: the fault -> teardown start.
            td = by.get("teardown")
            if td and by.get("exit"):
                out["latency_s"].append(td["latency_s"])
                out.setdefault("paths", []).append("exit")
            elif td and by.get("rank_exit"):
                out.setdefault("paths", []).append("rank_exit")
            if td and fault:
                out["from_fault_s"].append(td["start_mono"] - fault)
        else:
            found = by.get("hang" if mode == "liveness" else "no_progress")
            if found:
                out["latency_s"].append(found["latency_s"])
                if fault:
                    out["from_fault_s"].append(found["detected_mono"] - fault)
        if by.get("teardown_done"):
            out["teardown_s"].append(by["teardown_done"]["seconds"])
    return out


def summary(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return (
        f"median {statistics.median(xs) * 1000:.1f} ms, max {max(xs) * 1000:.1f} ms (n={len(xs)})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attempts", type=int, default=5)
    p.add_argument("--launcher", default="local", choices=("local", "mpiexec"))
    p.add_argument("--modes", default="exit,liveness,progress")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="es-detect-") as tmp:
        workdir = Path(tmp)
        (workdir / "bench_rank.py").write_text(RANK)
        print(f"launcher={args.launcher} attempts={args.attempts} interval=0.5 s timeout=2.0 s "
              f"train progress timeout=2.0 s check every 0.1 s")  # fmt: skip
        for mode in args.modes.split(","):
            t0 = time.monotonic()
            r = run_scenario(mode, args.attempts, args.launcher, workdir)
            what = {
                "exit": "launcher/rank exit -> teardown start",
                "liveness": "(last beat + timeout) -> hang detected",
                "progress": "(last step + timeout) -> no_progress detected",
            }[mode]
            print(f"\n[{mode}] ({time.monotonic() - t0:.0f} s)")
            if r.get("paths"):
                print(f"  detected by: {', '.join(sorted(set(r['paths'])))}")
            print(f"  {what}: {summary(r['latency_s'])}")
            if r["from_fault_s"]:
                print(
                    f"  fault -> detected (exit: -> teardown start): {summary(r['from_fault_s'])}"
                )
            print(f"  teardown duration: {summary(r['teardown_s'])}")


if __name__ == "__main__":
    main()
