"""Downtime per failure of the debug job, measured from the supervisor's own events.

Runs `python -m supervisor run configs/debug.toml` (real mpiexec, real worker, 2 ranks), and
`--kills` times, once the attempt has trained `--train-s` seconds past its first step, SIGKILLs
its ranks (all of them, as the study's `pkill -9` did, or `--target rank1`), noting the moment on
the shared monotonic clock. Per failure, from events.jsonl:

  downtime   kill -> the first productive step of the next attempt (`first_step`, as received)
  floor      the worker's own train/restart_seconds (process start -> first productive step,
             the `resumed` event): what the checkpoint issue measures as the restart floor
  ratio      downtime / floor (goal <= 1.3)
  and its parts: detect (kill -> launcher exit seen), teardown, relaunch (exit -> new launch),
  start (launch -> first step received); `ours` = kill -> new launch, the supervisor's share.

Usage: python bench/downtime.py [--kills 3] [--train-s 4] [--target all|rank1] [--launcher ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from supervisor.events import read_events  # noqa: E402


def events(run: Path) -> list[dict]:
    return list(read_events(run / "events.jsonl"))


def wait_event(run: Path, pred, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(run):
            if pred(e):
                return e
        if proc.poll() is not None:
            raise SystemExit(f"the supervisor exited early ({proc.returncode})")
        time.sleep(0.02)
    raise SystemExit("timed out waiting for an event")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "debug.toml"))
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--train-s", type=float, default=4.0)
    p.add_argument("--target", default="all", choices=("all", "rank1"))
    p.add_argument("--launcher", default=None, help="override [launch] launcher")
    p.add_argument("--set", action="append", default=[], help="more config overrides")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    with tempfile.TemporaryDirectory(prefix="es-downtime-") as tmp:
        run = Path(tmp) / "run"
        # The bench's own kills only: the demo config's [[faults]] are left out.
        sets = [f"job.run_dir={run}", "worker.train_iters=100000", "faults=[]", *args.set]
        if args.launcher:
            sets.append(f"launch.launcher={args.launcher}")
        cmd = [sys.executable, "-m", "supervisor", "run", args.config, "--quiet"]
        for s in sets:
            cmd += ["--set", s]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env)
        kills: list[float] = []
        try:
            for attempt in range(args.kills):
                wait_event(run, lambda e, a=attempt: e["event"] == "first_step"
                           and e["attempt"] == a, proc, 180)  # fmt: skip
                time.sleep(args.train_s)
                hellos = [e for e in events(run) if e["event"] == "rank_hello"
                          and e["attempt"] == attempt]  # fmt: skip
                pids = [e["pid"] for e in hellos if args.target == "all" or e["rank"] == 1]
                kills.append(time.monotonic())
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            wait_event(run, lambda e: e["event"] == "first_step" and e["attempt"] == args.kills,
                       proc, 180)  # fmt: skip
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        report(events(run), kills)


def report(evs: list[dict], kills: list[float]) -> None:
    def one(name: str, attempt: int) -> dict | None:
        return next((e for e in evs if e["event"] == name and e.get("attempt") == attempt), None)

    rows = []
    print(f"{'kill':>4} {'downtime':>9} {'floor':>7} {'ratio':>6} {'detect':>7} {'teardown':>8} "
          f"{'relaunch':>8} {'start':>7} {'ours':>6} {'resumed':>7}")  # fmt: skip
    for k, kill in enumerate(kills):
        ex, td = one("exit", k) or one("rank_exit", k), one("teardown_done", k)
        launch, resumed, first = (
            one("launch", k + 1),
            one("resumed", k + 1),
            one("first_step", k + 1),
        )
        if not (ex and td and launch and resumed and first):
            print(f"{k:>4} incomplete events")
            continue
        seen = ex.get("exit_mono", ex.get("detected_mono", ex["mono"]))
        downtime = first["mono"] - kill
        floor = resumed["restart_seconds"]
        rows.append((downtime, floor))
        print(f"{k:>4} {downtime:>8.2f}s {floor:>6.2f}s {downtime / floor:>6.2f} "
              f"{seen - kill:>6.3f}s {td['seconds']:>7.3f}s {launch['mono'] - seen:>7.3f}s "
              f"{first['mono'] - launch['mono']:>6.2f}s {launch['mono'] - kill:>5.2f}s "
              f"{resumed['step']:>7}")  # fmt: skip
    if rows:
        d = statistics.median(r[0] for r in rows)
        f = statistics.median(r[1] for r in rows)
        print(f"median downtime {d:.2f} s, floor {f:.2f} s, ratio {d / f:.2f} (goal <= 1.3)")


if __name__ == "__main__":
    main()
