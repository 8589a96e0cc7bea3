"""Downtime per failure, warm standby against cold relaunch, from the supervisor's own events.

Runs `python -m supervisor run` on the `debug` preset as it is (batch 1, no size overrides;
`--size 250m` for a 250M-parameter model) on 2 ranks under real mpiexec, once per `--standby`
mode, `--mem` mode (the memory checkpoint tier: `worker.mem_ckpt_interval=1`, a copy after
every step, its slots under a fresh ES_MEM_ROOT in /dev/shm) and `--target`, side by side in one
invocation.
Each run SIGKILLs its ranks (every rank, or rank 1) `--kills` times, each once the attempt has
made its first step and a checkpoint (a kill before it would resume from the same step again and
again), then (with the standby on) once the standby is ready, the case the feature is for, and
then `--train-s` seconds more, noting the moment on the shared monotonic clock. Per failure, from
events.jsonl (and rank 0's metrics):

  downtime   kill -> the first step of the next attempt (`first_step`, as received)
  restart    the worker's own train/restart_seconds: process start (cold) or `go` (warm) ->
             the first step done (the `resumed` event)
  detect     kill -> the launcher's exit (or the finding) seen
  relaunch   the launcher's exit seen -> the next attempt launched (cold) or told to go (warm)
  how        warm | cold, as the job's `relaunch` event says
  lost       steps lost: the newest step done before the kill minus the step resumed from
             (supervisor.reporting.analysis's per-failure figure)
  from       memory | durable: where the resume came from (the `resumed` event's `source`)
  cost       kill -> the first step PAST the newest step done before the kill (rank 0's metrics
             record of it): what the kill cost, the lost steps' recompute included
  prep cost  what the standby's preparation cost the attempt it ran beside: the seconds that
             attempt's steps took beyond its median step while the standby prepared (on a host
             whose cores the ranks fill, the standby's imports and build compete for them)

  over       cost minus the run's steady step (below): what the kill cost beyond the one step
             that had to be done again anyway

And the startup/* parts of the first step of every relaunched attempt (metrics-0.jsonl), warm
next to cold. The steady step is measured in the same run: the median `train/dt` of rank 0's
steps, leaving out each attempt's first step and the steps that overlapped a standby's
preparation (launch -> ready); each run ends with 5 such steps after its last kill. Goals:
(issue 15) warm downtime <= 0.5 s median and <= 0.25x cold; (issue 16) with the memory tier,
<= 1 step lost per SIGKILL of every rank, and with the standby also on a cost <= 1.0 s median on
the debug preset; (issue 27) with the standby and the memory tier, a kill of every rank: median
cost <= the steady step + 0.15 s.

The last line is one JSON object: per run, the median downtime and cost, the steady step and the
margin (median cost minus steady step) against the goal of 0.15 s.

Usage: python bench/downtime.py [--standby on,off] [--mem off|on|on,off] [--target all,rank1]
                                [--kills 3] [--train-s 2] [--keep] [--size debug|250m]
                                [--set key=value ...] [--when ready|unready]

`--when unready` kills right after the standby's launch (once the attempt has stepped and made
a checkpoint: one every step, `worker.save_interval=1`), before its `standby_ready`: the case
where the standby cannot be used (issue 27: an unready standby must never make the relaunch
slower than none).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# What a run's events and metrics say, beside this script (a script's folder is on sys.path).
from downtime_figures import PARTS, records, row, steady_step  # noqa: E402

from supervisor.log.events import read_events  # noqa: E402
from supervisor.reporting.analysis import analyze  # noqa: E402
from supervisor.reporting.load import load_run  # noqa: E402
from supervisor.settings import toml_dump  # noqa: E402

SIZE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len",
             "batch_size")  # fmt: skip
SIZES = {
    # The preset itself: dim 128, 4 layers, vocab 32000, seq 256; batch 1 as issue 15 measured
    # it (the worker's default batch is 2, which doubles the step and so the downtime's floor).
    "debug": {"batch_size": 1},
    # bench/step.py's ~250M model
    "250m": {
        "dim": 1024,
        "n_layers": 16,
        "n_heads": 16,
        "n_kv_heads": 4,
        "ffn_dim": 2816,
        "seq_len": 128,
    },  # fmt: skip
}
STEADY_STEPS = 5  # at the end of a run: steps with no standby preparing, for the steady step
MARGIN_GOAL_S = 0.15  # issue 27: warm, memory tier: median cost <= the steady step + this


def events(run: Path) -> list[dict]:
    return list(read_events(run / "events.jsonl")) if (run / "events.jsonl").exists() else []


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


def bench_config(base: Path, size: str, out: Path) -> Path:
    """The demo config with the preset's own sizes (or the 250M ones) and no faults."""
    raw = tomllib.loads(base.read_text())
    worker = {k: v for k, v in raw.get("worker", {}).items() if k not in SIZE_KEYS}
    worker.update(SIZES[size], model="debug", train_iters=100000)
    if size != "debug":
        worker["save_interval"] = 3  # seconds per step here: keep the lost work small
        raw.setdefault("heartbeat", {}).setdefault("progress", {})["train"] = 300
    raw.update(worker=worker, faults=[])
    out.write_text(toml_dump.dumps(raw))
    return out


def label(key: tuple[str, str, bool]) -> str:
    how, target, mem = key
    return f"{how}/{target}" + ("/mem" if mem else "")


def run_one(args, standby: bool, target: str, mem: bool, tmp: Path) -> tuple[list[dict], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    run = tmp / f"run-{'warm' if standby else 'cold'}-{target}{'-mem' if mem else ''}"
    cfg = bench_config(Path(args.config), args.size, tmp / f"{run.name}.toml")
    sets = [f"job.run_dir={run}", f"restart.standby={'true' if standby else 'false'}"]
    mem_root = None
    if mem:  # the slots in a directory of this run's own, removed at its end
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        mem_root = Path(tempfile.mkdtemp(prefix="es-downtime-mem-", dir=shm))
        env["ES_MEM_ROOT"] = str(mem_root)
        sets.append("worker.mem_ckpt_interval=1")
    else:  # the demo config keeps a memory copy every step: off means off
        sets.append("worker.mem_ckpt_interval=0")
    if args.when == "unready":  # a checkpoint at the first step: the kill follows at once
        sets.append("worker.save_interval=1")
    sets += args.set
    cmd = [sys.executable, "-m", "supervisor", "run", str(cfg), "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    kills: list[dict] = []
    timeout = 600 if args.size != "debug" else 180
    try:
        attempt = 0
        for _ in range(args.kills):
            first = wait_event(run, lambda e, a=attempt: e["event"] == "first_step"
                               and e["attempt"] == a, proc, timeout)  # fmt: skip
            # A checkpoint of this attempt first: kills before it would resume from the same
            # step again and again (and end the job as making no progress).
            wait_event(run, lambda e, a=attempt: e["event"] == "ckpt_complete"
                       and e["attempt"] == a, proc, timeout)  # fmt: skip
            if standby and args.when == "unready":  # right after the standby's launch
                launched = wait_event(run, lambda e, f=first: e["event"] == "standby_launch"
                                      and e["mono"] > f["mono"], proc, timeout)  # fmt: skip
            elif standby:
                wait_event(run, lambda e, f=first: e["event"] == "standby_ready"
                           and e["mono"] > f["mono"], proc, timeout)  # fmt: skip
            if args.when == "ready":
                time.sleep(args.train_s)
            hellos = [e for e in events(run) if e["event"] == "rank_hello"
                      and e["attempt"] == attempt]  # fmt: skip
            pids = [e["pid"] for e in hellos if target == "all" or e["rank"] == 1]
            kill, kill_wall = time.monotonic(), time.time()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            relaunch = wait_event(run, lambda e, a=attempt: e["event"] == "relaunch"
                                  and e["after"] == a, proc, 60)  # fmt: skip
            kills.append({"attempt": attempt, "kill": kill, "kill_wall": kill_wall,
                          "next": relaunch["attempt"]})  # fmt: skip
            if standby and args.when == "unready" and any(
                e["event"] == "standby_ready" and e["attempt"] == launched["attempt"]
                and e["mono"] < kill for e in events(run)
            ):  # fmt: skip
                print(f"NOTE: {run.name}: the standby was ready before kill {len(kills)}")
            if standby and args.when == "unready":
                age = kill - launched["mono"]
                print(f"{run.name}: kill {len(kills)}, {age:.2f} s after the standby's launch")
            attempt = relaunch["attempt"]
        wait_event(run, lambda e: e["event"] == "first_step" and e["attempt"] == attempt, proc,
                   timeout)  # fmt: skip
        if kills:  # the last relaunch past the newest step before its kill: its cost is known
            wait_past(run, kills[-1]["attempt"], attempt, proc, timeout)
        # Steady steps to measure the step by: on a loaded host a standby's preparation can
        # overlap every step before a kill.
        after = time.time()
        if standby:
            after = wait_event(run, lambda e, a=attempt: e["event"] == "standby_ready"
                               and e["attempt"] > a, proc, timeout)["ts"]  # fmt: skip
        wait_steps(run, attempt, after, STEADY_STEPS, proc, timeout)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        if mem_root is not None:
            left = sorted(p.name for p in mem_root.iterdir())
            if left:  # the supervisor removes the job's memory dir at its end
                print(f"NOTE: {run.name}: left in ES_MEM_ROOT after the job: {left}")
            shutil.rmtree(mem_root, ignore_errors=True)
    failures = {f.attempt: f for f in analyze(load_run(run)).failures}
    evs = events(run)
    return [row(evs, k, run, failures.get(k["attempt"])) for k in kills], steady_step(evs, run)


def wait_past(run: Path, killed: int, attempt: int, proc: subprocess.Popen, timeout: float):
    """Until `attempt` has done a step past the newest step `killed` reached (attempt_end's
    max_step; no wait when it is not known)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        end = next((e for e in events(run) if e["event"] == "attempt_end"
                    and e["attempt"] == killed), None)  # fmt: skip
        if end is not None and end.get("max_step") is None:
            return
        if end is not None and any(r["step"] > end["max_step"] for r in records(run, attempt)):
            return
        if proc.poll() is not None:
            raise SystemExit(f"the supervisor exited early ({proc.returncode})")
        time.sleep(0.05)
    raise SystemExit("timed out waiting for a step past the kill")


def wait_steps(
    run: Path, attempt: int, after: float, n: int, proc: subprocess.Popen, timeout: float
):
    """Until `attempt` has done `n` steps that began after `after` (wall clock)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r["t"] - r["train/dt"] > after for r in records(run, attempt)) >= n:
            return
        if proc.poll() is not None:
            raise SystemExit(f"the supervisor exited early ({proc.returncode})")
        time.sleep(0.05)
    raise SystemExit("timed out waiting for steady steps")


def show(title: str, rows: list[dict], step: float | None) -> dict[str, float | None]:
    print(f"\n{title}")
    print(f"{'#':>3} {'how':>5} {'downtime':>9} {'restart':>8} {'detect':>7} {'relaunch':>9} "
          f"{'resumed':>8} {'prep cost':>10} {'lost':>5} {'from':>8} {'cost':>8} "
          f"{'over':>7}")  # fmt: skip
    good = [r for r in rows if not r.get("incomplete")]
    for i, r in enumerate(rows):
        if r.get("incomplete"):
            print(f"{i:>3} {r['how']:>5} incomplete events")
            continue
        restart = f"{r['restart']:.3f}s" if r["restart"] is not None else "–"
        prep = f"{r['prep_cost']:.2f}s" if r["prep_cost"] is not None else "–"
        lost = str(r["lost"]) if r["lost"] is not None else "–"
        cost = f"{r['cost']:.3f}s" if r["cost"] is not None else "–"
        known = r["cost"] is not None and step is not None
        over = f"{r['cost'] - step:+.3f}s" if known else "–"
        print(f"{i:>3} {r['how']:>5} {r['downtime']:>8.3f}s {restart:>8} {r['detect']:>6.3f}s "
              f"{r['relaunch']:>8.3f}s {r['resumed']:>8} {prep:>10} {lost:>5} "
              f"{r['source'] or '–':>8} {cost:>8} {over:>7}")  # fmt: skip
    if not good:
        return {"step": step}
    out = {"downtime": statistics.median(r["downtime"] for r in good), "step": step}
    losts = [r["lost"] for r in good if r["lost"] is not None]
    costs = [r["cost"] for r in good if r["cost"] is not None]
    out["lost"] = statistics.median(losts) if losts else None
    out["lost_max"] = max(losts) if losts else None
    out["cost"] = statistics.median(costs) if costs else None
    line = f"    median downtime {out['downtime']:.3f} s over {len(good)} kills"
    if out["lost"] is not None:
        line += f"; median lost {out['lost']:g} steps (max {out['lost_max']})"
    if out["cost"] is not None:
        line += f"; median cost {out['cost']:.3f} s"
    if step is not None:
        line += f"; steady step {step:.3f} s"
    print(line)
    return out


def show_parts(results: dict) -> None:
    print("\nstartup/* of the relaunched attempts' first step (median s; warm: restart counts "
          "from `go`)")  # fmt: skip
    cols = [(key, [r["parts"] for r in rows if not r.get("incomplete") and r["parts"]])
            for key, rows in results.items()]  # fmt: skip
    print(f"{'part':>14} " + " ".join(f"{label(k):>14}" for k, _ in cols))
    for part in (*PARTS, "prepare"):
        cells = []
        for _, parts in cols:
            vals = [p[part] for p in parts if part in p]
            cells.append(f"{statistics.median(vals):>14.3f}" if vals else f"{'–':>14}")
        print(f"{part:>14} " + " ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "debug.toml"))
    p.add_argument("--standby", default="on,off", help="on, off or on,off (both, side by side)")
    p.add_argument("--mem", default="off", help="the memory tier: off, on or on,off")
    p.add_argument("--target", default="all,rank1", help="all, rank1 or all,rank1")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--train-s", type=float, default=2.0)
    p.add_argument("--keep", action="store_true", help="keep the run dirs (printed)")
    p.add_argument("--size", default="debug", choices=sorted(SIZES))
    p.add_argument("--set", action="append", default=[], help="more config overrides")
    p.add_argument(
        "--when",
        default="ready",
        choices=("ready", "unready"),
        help="kill once the standby is ready and --train-s later, or right after "
        "the standby's launch, before it is ready (standby off: at the same point)",
    )
    args = p.parse_args()
    modes = [m.strip() == "on" for m in args.standby.split(",")]
    mems = [m.strip() == "on" for m in args.mem.split(",")]
    targets = [t.strip() for t in args.target.split(",")]
    results: dict[tuple[str, str, bool], list[dict]] = {}
    steps: dict[tuple[str, str, bool], float | None] = {}
    tmp = Path(tempfile.mkdtemp(prefix="es-downtime-"))
    try:
        for target in targets:
            for standby in modes:
                for mem in mems:
                    key = ("warm" if standby else "cold", target, mem)
                    results[key], steps[key] = run_one(args, standby, target, mem, tmp)
    finally:
        if args.keep:
            print(f"run dirs kept under {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    medians = {
        k: show(f"standby {'on' if k[0] == 'warm' else 'off'}, memory tier "
                f"{'on' if k[2] else 'off'}, kill {k[1]}", rows, steps[k])
        for k, rows in results.items()
    }  # fmt: skip
    show_parts(results)
    print()
    for target in targets:
        for mem in mems:
            w = medians.get(("warm", target, mem), {}).get("downtime")
            c = medians.get(("cold", target, mem), {}).get("downtime")
            if w is not None and c is not None and args.when == "unready":
                ok = "MET" if w <= c + 0.2 else "NOT MET"
                print(f"kill {target}, standby not ready: on {w:.3f} s vs off {c:.3f} s "
                      f"median downtime, {w - c:+.3f} s (goal <= +0.2 s): {ok}")  # fmt: skip
            elif w is not None and c is not None:
                print(f"kill {target}{', memory tier on' if mem else ''}: warm {w:.3f} s vs "
                      f"cold {c:.3f} s median downtime: {w / c:.2f}x "
                      f"(goal <= 0.5 s and <= 0.25x)")  # fmt: skip
    for key, m in medians.items():
        if not key[2] or key[1] != "all" or m.get("lost_max") is None:
            continue
        ok = "MET" if m["lost_max"] <= 1 else "NOT MET"
        print(f"{label(key)}: lost steps per SIGKILL of every rank: median {m['lost']:g}, max "
              f"{m['lost_max']} (goal <= 1): {ok}")  # fmt: skip
        if key[0] == "warm" and m.get("cost") is not None and args.size == "debug":
            ok = "MET" if m["cost"] <= 1.0 else "NOT MET"
            print(f"{label(key)}: median cost {m['cost']:.3f} s (goal <= 1.0 s): {ok}")
        if key[0] == "warm" and m.get("cost") is not None and m.get("step") is not None:
            margin = m["cost"] - m["step"]
            ok = "MET" if margin <= MARGIN_GOAL_S else "NOT MET"
            print(
                f"{label(key)}: median cost {m['cost']:.3f} s against a steady step of "
                f"{m['step']:.3f} s: {margin:+.3f} s (goal <= +{MARGIN_GOAL_S} s): {ok}"
            )
    print(json.dumps({"downtime": [summary(key, m, results[key]) for key, m in medians.items()]}))


def summary(key: tuple[str, str, bool], m: dict, rows: list[dict]) -> dict:
    """One run's medians for the last line: cost against the steady step of the same run."""
    cost, step = m.get("cost"), m.get("step")
    margin = round(cost - step, 3) if cost is not None and step is not None else None
    return {
        "run": label(key),
        "kills": len(rows),
        "downtime_median_s": round(m["downtime"], 3) if "downtime" in m else None,
        "cost_median_s": round(cost, 3) if cost is not None else None,
        "step_median_s": round(step, 3) if step is not None else None,
        "margin_s": margin,
        "margin_goal_s": MARGIN_GOAL_S,
        "met": margin <= MARGIN_GOAL_S if margin is not None and key[0] == "warm" else None,
    }


if __name__ == "__main__":
    main()
