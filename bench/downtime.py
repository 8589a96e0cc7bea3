"""Downtime per failure, warm standby against cold relaunch, from the supervisor's own events.

Runs `python -m supervisor run` on the `debug` preset as it is (no size overrides; `--size 250m`
for a 250M-parameter model) on 2 ranks under real mpiexec, once per `--standby` mode and
`--target`, side by side in one invocation. Each run SIGKILLs its ranks (every rank, or rank 1)
`--kills` times, each once the attempt has made its first step and a checkpoint (a kill before
it would resume from the same step again and again), then (with the standby on) once the standby
is ready, the case the feature is for, and then `--train-s` seconds more, noting the moment on
the shared monotonic clock. Per failure, from events.jsonl:

  downtime   kill -> the first step of the next attempt (`first_step`, as received)
  restart    the worker's own train/restart_seconds: process start (cold) or `go` (warm) ->
             the first step done (the `resumed` event)
  detect     kill -> the launcher's exit (or the finding) seen
  relaunch   the launcher's exit seen -> the next attempt launched (cold) or told to go (warm)
  how        warm | cold, as the job's `relaunch` event says
  prep cost  what the standby's preparation cost the attempt it ran beside: the seconds that
             attempt's steps took beyond its median step while the standby prepared (on a host
             whose cores the ranks fill, the standby's imports and build compete for them)

And the startup/* parts of the first step of every relaunched attempt (metrics-0.jsonl), warm
next to cold. Goal (issue 15): warm downtime <= 0.5 s median and <= 0.25x cold.

Usage: python bench/downtime.py [--standby on,off] [--target all,rank1] [--kills 3]
                                [--train-s 2] [--keep] [--size debug|250m] [--set key=value ...]
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
from supervisor import config as config_mod  # noqa: E402
from supervisor.events import read_events  # noqa: E402

SIZE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len",
             "batch_size")  # fmt: skip
SIZES = {
    "debug": {},  # the preset itself: dim 128, 4 layers, vocab 32000, seq 256, batch 1
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
PARTS = ("imports", "process_group", "model_build", "warmup", "standby_wait", "choose", "load",
         "first_step")  # fmt: skip


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
    out.write_text(config_mod.dumps(raw))
    return out


def run_one(args, standby: bool, target: str, tmp: Path) -> tuple[list[dict], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    run = tmp / f"run-{'warm' if standby else 'cold'}-{target}"
    cfg = bench_config(Path(args.config), args.size, tmp / f"{run.name}.toml")
    sets = [f"job.run_dir={run}", f"restart.standby={'true' if standby else 'false'}", *args.set]
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
            if standby:
                wait_event(run, lambda e, f=first: e["event"] == "standby_ready"
                           and e["mono"] > f["mono"], proc, timeout)  # fmt: skip
            time.sleep(args.train_s)
            hellos = [e for e in events(run) if e["event"] == "rank_hello"
                      and e["attempt"] == attempt]  # fmt: skip
            pids = [e["pid"] for e in hellos if target == "all" or e["rank"] == 1]
            kill = time.monotonic()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            relaunch = wait_event(run, lambda e, a=attempt: e["event"] == "relaunch"
                                  and e["after"] == a, proc, 60)  # fmt: skip
            kills.append({"attempt": attempt, "kill": kill, "next": relaunch["attempt"]})
            attempt = relaunch["attempt"]
        wait_event(run, lambda e: e["event"] == "first_step" and e["attempt"] == attempt, proc,
                   timeout)  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return [row(events(run), k, run) for k in kills], run


def row(evs: list[dict], k: dict, run: Path) -> dict:
    def one(name: str, attempt: int) -> dict | None:
        return next((e for e in evs if e["event"] == name and e.get("attempt") == attempt), None)

    a, n = k["attempt"], k["next"]
    ex = one("exit", a) or one("rank_exit", a) or one("hang", a)
    relaunch = next(e for e in evs if e["event"] == "relaunch" and e.get("after") == a)
    started = one("standby_go", n) or one("launch", n)
    resumed, first = one("resumed", n), one("first_step", n)
    out = {"how": relaunch.get("mode", "cold"), "next": n}
    if not (ex and started and first):
        return {**out, "incomplete": True}
    seen = ex.get("exit_mono", ex.get("detected_mono", ex["mono"]))
    out.update(
        prep_cost=prep_cost(evs, a, n, run),
        downtime=first["mono"] - k["kill"],
        restart=resumed["restart_seconds"] if resumed else None,
        detect=seen - k["kill"],
        relaunch=started["mono"] - seen,
        resumed=resumed["step"] if resumed else 0,
        parts=startup_parts(run / "attempts" / f"{n:03d}" / "metrics-0.jsonl"),
    )
    return out


def prep_cost(evs: list[dict], a: int, n: int, run: Path) -> float | None:
    """What the standby's preparation cost attempt `a` that it ran beside: the seconds its steps
    took beyond the attempt's own median step while standby `n` prepared (launch -> ready)."""
    launch = next((e for e in evs if e["event"] == "standby_launch" and e["attempt"] == n), None)
    ready = next((e for e in evs if e["event"] == "standby_ready" and e["attempt"] == n), None)
    if launch is None or ready is None:
        return None
    try:
        lines = (run / "attempts" / f"{a:03d}" / "metrics-0.jsonl").read_text().splitlines()
        steps = [json.loads(x) for x in lines][1:]  # not the first: it is a start's
    except (OSError, ValueError):
        return None
    # A step's record is written when it ends: it overlapped the window if it ended after the
    # launch and began before the ready.
    inside = [r for r in steps if launch["ts"] < r["t"] and r["t"] - r["train/dt"] < ready["ts"]]
    outside = [r["train/dt"] for r in steps if r not in inside]
    if not inside or not outside:
        return None
    steady = statistics.median(outside)
    return sum(max(0.0, r["train/dt"] - steady) for r in inside)


def startup_parts(path: Path) -> dict[str, float]:
    try:
        first = json.loads(path.read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return {}
    parts = {p: first[f"startup/{p}"] for p in PARTS if f"startup/{p}" in first}
    if "train/standby_prepare_seconds" in first:
        parts["prepare"] = first["train/standby_prepare_seconds"]
    return parts


def show(label: str, rows: list[dict]) -> float | None:
    print(f"\n{label}")
    print(f"{'#':>3} {'how':>5} {'downtime':>9} {'restart':>8} {'detect':>7} {'relaunch':>9} "
          f"{'resumed':>8} {'prep cost':>10}")  # fmt: skip
    good = [r for r in rows if not r.get("incomplete")]
    for i, r in enumerate(rows):
        if r.get("incomplete"):
            print(f"{i:>3} {r['how']:>5} incomplete events")
            continue
        restart = f"{r['restart']:.3f}s" if r["restart"] is not None else "–"
        cost = f"{r['prep_cost']:.2f}s" if r["prep_cost"] is not None else "–"
        print(f"{i:>3} {r['how']:>5} {r['downtime']:>8.3f}s {restart:>8} {r['detect']:>6.3f}s "
              f"{r['relaunch']:>8.3f}s {r['resumed']:>8} {cost:>10}")  # fmt: skip
    if not good:
        return None
    median = statistics.median(r["downtime"] for r in good)
    print(f"    median downtime {median:.3f} s over {len(good)} kills")
    return median


def show_parts(results: dict) -> None:
    print("\nstartup/* of the relaunched attempts' first step (median s; warm: restart counts "
          "from `go`)")  # fmt: skip
    cols = [(key, [r["parts"] for r in rows if not r.get("incomplete") and r["parts"]])
            for key, rows in results.items()]  # fmt: skip
    print(f"{'part':>14} " + " ".join(f"{'/'.join(k):>12}" for k, _ in cols))
    for part in (*PARTS, "prepare"):
        cells = []
        for _, parts in cols:
            vals = [p[part] for p in parts if part in p]
            cells.append(f"{statistics.median(vals):>12.3f}" if vals else f"{'–':>12}")
        print(f"{part:>14} " + " ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "debug.toml"))
    p.add_argument("--standby", default="on,off", help="on, off or on,off (both, side by side)")
    p.add_argument("--target", default="all,rank1", help="all, rank1 or all,rank1")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--train-s", type=float, default=2.0)
    p.add_argument("--keep", action="store_true", help="keep the run dirs (printed)")
    p.add_argument("--size", default="debug", choices=sorted(SIZES))
    p.add_argument("--set", action="append", default=[], help="more config overrides")
    args = p.parse_args()
    modes = [m.strip() == "on" for m in args.standby.split(",")]
    targets = [t.strip() for t in args.target.split(",")]
    results: dict[tuple[str, str], list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="es-downtime-"))
    try:
        for target in targets:
            for standby in modes:
                rows, _ = run_one(args, standby, target, tmp)
                results[("warm" if standby else "cold", target)] = rows
    finally:
        if args.keep:
            print(f"run dirs kept under {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    medians = {k: show(f"standby {'on' if k[0] == 'warm' else 'off'}, kill {k[1]}", rows)
               for k, rows in results.items()}  # fmt: skip
    show_parts(results)
    print()
    for target in targets:
        w, c = medians.get(("warm", target)), medians.get(("cold", target))
        if w is not None and c is not None:
            print(f"kill {target}: warm {w:.3f} s vs cold {c:.3f} s median: {w / c:.2f}x "
                  f"(goal <= 0.5 s and <= 0.25x)")  # fmt: skip


if __name__ == "__main__":
    main()
