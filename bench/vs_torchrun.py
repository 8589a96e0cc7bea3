"""The same worker, model and kills under `torchrun --max-restarts` and under the supervisor.

Per failure, side by side: detection latency (kill -> the launcher noticed: torchrun's own log
line "failed (exitcode ...)" / "closing signal" / "attempts left"; the supervisor's `teardown`
event), downtime (kill -> the first productive step after resume, from rank 0's metrics) and
lost steps (the newest step done before the kill - the step resumed from). Then a hang: one rank
SIGSTOPped; whether and when each notices (torchrun has no liveness check: it notices only when
the survivors' collective times out, at the worker's --pg-timeout).

torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with its default (the ranks' process
group on the rendezvous store), restarts here often failed to form the gloo mesh (connection
refused to a port of the previous attempt, pytorch/pytorch#135712); `--share-store` shows that.

Kills land once an attempt has trained `--train-s` seconds past its first step; `--target all`
SIGKILLs every rank (the study's pkill -9), `rank1` only rank 1.

Usage: python bench/vs_torchrun.py [--kills 2] [--train-s 4] [--target all|rank1]
                                   [--hang-wait 75] [--pg-timeout 45] [--skip-hang]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from supervisor.launch.malloc_env import huge_pages_env  # noqa: E402
from supervisor.log.events import read_events  # noqa: E402
from supervisor.settings import config as config_mod  # noqa: E402

TORCH_LOG = re.compile(r"^[IWEC](\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ .*?\] (.*)$")
NOTICED = ("failed (exitcode", "closing signal", "attempts left", "Worker group FAILED")
WAIT_S = 240


@dataclass
class Row:
    side: str
    kill: int
    detection_s: float | None
    downtime_s: float | None
    lost_steps: int | None
    resumed_from: int | None
    restart_s: float | None


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = str(REPO)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    # The project's ranks ask for huge pages by default ([launch] huge_pages); torchrun's are
    # given the same, so that what is compared is the handling of failures, not the allocator.
    e.update(huge_pages_env(True, {}, e))
    return e


def worker_flags(pg_timeout: float) -> dict:
    raw = tomllib.loads((REPO / "configs" / "debug.toml").read_text())["worker"]
    raw.pop("module", None)
    raw.update(train_iters=100000, save_interval=10, pg_timeout=int(pg_timeout))
    return raw


def records(path: Path) -> list[dict]:
    return list(read_events(path))


def wait(pred, proc: subprocess.Popen, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        if proc.poll() is not None:
            raise SystemExit(f"the launcher exited early ({proc.returncode}): {proc.args[:6]}")
        time.sleep(0.02)
    raise SystemExit("timed out")


def rank_pids(root: int) -> dict[int, int]:
    """rank -> pid of the worker processes under a launcher (RANK from their environment)."""
    out = {}
    for p in psutil.Process(root).children(recursive=True):
        try:
            if "worker.train" in " ".join(p.cmdline()):
                rank = p.environ().get("RANK") or p.environ().get("PMI_RANK")
                if rank is not None:
                    out[int(rank)] = p.pid
        except (psutil.Error, ValueError):
            continue
    return out


def kill_ranks(pids: dict[int, int], target: str, sig=signal.SIGKILL) -> tuple[float, float]:
    chosen = [pid for r, pid in pids.items() if target == "all" or r == 1]
    wall, mono = time.time(), time.monotonic()
    for pid in chosen:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return wall, mono


def per_kill(metrics: list[dict], kills: list[float]) -> list[tuple]:
    """(downtime, lost, resumed_from, restart_s) per kill, from rank 0's metrics (wall clock)."""
    out = []
    for i, k in enumerate(kills):
        before = [r for r in metrics if r["t"] < k]
        nxt = kills[i + 1] if i + 1 < len(kills) else float("inf")
        after = [r for r in metrics if k < r["t"] < nxt and "train/restart_seconds" in r]
        if not before or not after:
            out.append((None, None, None, None))
            continue
        first = after[0]
        resumed = first["step"] - 1
        done = max(r["step"] for r in before)
        out.append((first["t"] - k, done - resumed, resumed, first["train/restart_seconds"]))
    return out


# --- torchrun ------------------------------------------------------------------------
def torchrun_side(args, tmp: Path) -> tuple[list[Row], str]:
    out, ckpt = tmp / "tr-out", tmp / "tr-ckpt"
    flags = {**worker_flags(args.pg_timeout), "ckpt_dir": str(ckpt), "outdir": str(out)}
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(args.kills + 1),
        "-m",
        "worker.train",
        *config_mod.flags_from_table(flags),
    ]
    log = (tmp / "torchrun.log").open("w")
    tr_env = env()
    if not args.share_store:  # pytorch/pytorch#135712: stale ports from the previous restart
        tr_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=tr_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    metrics = out / "metrics-0.jsonl"
    kills_wall: list[float] = []
    hang = "not run"
    try:
        for _ in range(args.kills):
            since = kills_wall[-1] if kills_wall else 0.0
            first = wait(
                lambda s=since: next((r for r in records(metrics) if r["t"] > s), None), proc
            )
            time.sleep(max(0.0, args.train_s - (time.time() - first["t"])))
            pids = wait(lambda: (p := rank_pids(proc.pid)) and len(p) == 2 and p, proc)
            kills_wall.append(kill_ranks(pids, args.target)[0])
        since = kills_wall[-1] if kills_wall else 0.0
        wait(lambda: any(r["t"] > since for r in records(metrics)), proc)
        if not args.skip_hang:
            hang = torchrun_hang(args, proc, metrics, tmp / "torchrun.log")
    except SystemExit as exc:  # torchrun gave up (its restarts spent): report what it did
        hang = f"torchrun ended before the hang test: {exc} (see torchrun.log with --keep)"
    finally:
        stop(proc)
        log.close()
    text = (tmp / "torchrun.log").read_text(errors="replace")
    noticed = notice_times(text, datetime.fromtimestamp(kills_wall[0]) if kills_wall else None)
    rows = []
    for i, (k, (down, lost, resumed, restart)) in enumerate(
        zip(kills_wall, per_kill(records(metrics), kills_wall), strict=True)
    ):
        det = next((t - k for t in noticed if t >= k), None)
        rows.append(Row("torchrun", i + 1, det, down, lost, resumed, restart))
    return rows, hang


def notice_times(text: str, day: datetime | None) -> list[float]:
    """Wall times of torchrun's lines that say it saw a worker fail."""
    if day is None:
        return []
    out = []
    for line in text.splitlines():
        m = TORCH_LOG.match(line)
        if not m or not any(s in m.group(3) for s in NOTICED):
            continue
        stamp = datetime.strptime(f"{day.year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
        out.append(stamp.timestamp())
    return sorted(out)


def torchrun_hang(args, proc, metrics: Path, log_path: Path) -> str:
    pids = wait(lambda: (p := rank_pids(proc.pid)) and len(p) == 2 and p, proc)
    time.sleep(args.train_s)
    stopped, _ = kill_ranks({1: pids[1]}, "rank1", signal.SIGSTOP)
    deadline = time.time() + args.hang_wait
    try:
        while time.time() < deadline:
            seen = [
                t
                for t in notice_times(
                    log_path.read_text(errors="replace"), datetime.fromtimestamp(stopped)
                )
                if t > stopped
            ]
            if seen:
                return f"noticed after {seen[0] - stopped:.1f} s (the collective timed out)"
            if proc.poll() is not None:
                return f"torchrun exited ({proc.returncode}) after {time.time() - stopped:.1f} s"
            time.sleep(0.2)
        return f"not noticed within {args.hang_wait:.0f} s"
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(20)


# --- supervisor ------------------------------------------------------------------------
def events(run: Path) -> list[dict]:
    return records(run / "events.jsonl")


def supervisor_side(args, tmp: Path) -> tuple[list[Row], str]:
    run = tmp / "sup-run"
    sets = [f"job.run_dir={run}", "faults=[]", f"restart.max_restarts={args.kills + 2}"]
    sets += [f"worker.{k}={json.dumps(v)}" for k, v in worker_flags(args.pg_timeout).items()]
    cmd = [
        sys.executable,
        "-m",
        "supervisor",
        "run",
        str(REPO / "configs" / "debug.toml"),
        "--quiet",
        "--no-report",
    ]
    for s in sets:
        cmd += ["--set", s]
    log = (tmp / "supervisor.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    kills: list[tuple[float, float]] = []
    hang = "not run"
    try:
        for a in range(args.kills):
            wait(
                lambda a=a: any(
                    e["event"] == "first_step" and e["attempt"] == a for e in events(run)
                ),
                proc,
            )
            time.sleep(args.train_s)
            kills.append(kill_ranks(hello_pids(run, a), args.target))
        n = args.kills
        wait(
            lambda: any(e["event"] == "first_step" and e["attempt"] == n for e in events(run)), proc
        )
        if not args.skip_hang:
            time.sleep(args.train_s)
            stopped_mono = kill_ranks({1: hello_pids(run, n)[1]}, "rank1", signal.SIGSTOP)[1]
            hang_ev = wait(
                lambda: next((e for e in events(run) if e["event"] == "hang"), None),
                proc,
                args.hang_wait,
            )
            hang = (
                f"noticed after {hang_ev['detected_mono'] - stopped_mono:.1f} s "
                f"(liveness: no beat for timeout_s)"
            )
    finally:
        stop(proc)
        log.close()
    evs = events(run)
    rows = []
    downs = per_kill(
        [
            r
            for a in sorted((run / "attempts").glob("[0-9]*"))
            for r in records(a / "metrics-0.jsonl")
        ],
        [w for w, _ in kills],
    )
    for i, ((_, mono), (down, lost, resumed, restart)) in enumerate(zip(kills, downs, strict=True)):
        td = next((e for e in evs if e["event"] == "teardown" and e["attempt"] == i), None)
        det = td["start_mono"] - mono if td else None
        rows.append(Row("supervisor", i + 1, det, down, lost, resumed, restart))
    return rows, hang


def hello_pids(run: Path, attempt: int) -> dict[int, int]:
    return {
        e["rank"]: e["pid"]
        for e in events(run)
        if e["event"] == "rank_hello" and e["attempt"] == attempt
    }


def fmt(v, digits=2) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--train-s", type=float, default=4.0)
    p.add_argument("--target", default="all", choices=("all", "rank1"))
    p.add_argument("--hang-wait", type=float, default=75.0)
    p.add_argument("--pg-timeout", type=float, default=45.0, help="the worker's --pg-timeout")
    p.add_argument("--skip-hang", action="store_true")
    p.add_argument("--keep", metavar="DIR", help="keep logs, metrics and run dirs here")
    p.add_argument(
        "--share-store",
        action="store_true",
        help="leave torchrun sharing its rendezvous TCPStore with the ranks (torch's default; "
        "here its restarts then often fail to form the gloo mesh: pytorch/pytorch#135712)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="es-vs-torchrun-") as t:
        tmp = Path(args.keep) if args.keep else Path(t)
        tmp.mkdir(parents=True, exist_ok=True)
        tr_rows, tr_hang = torchrun_side(args, tmp)
        sup_rows, sup_hang = supervisor_side(args, tmp)
    print(
        f"debug model, 2 ranks, checkpoint every 10 steps, SIGKILL {args.target}, "
        f"{args.train_s:g} s into each attempt; worker --pg-timeout {args.pg_timeout:g}"
    )
    print(
        "| kill | side | detection (s) | downtime (s) | lost steps | resumed from | restart (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k in range(max(len(tr_rows), len(sup_rows))):
        for r in (rows[k] for rows in (tr_rows, sup_rows) if k < len(rows)):
            print(
                f"| {r.kill} | {r.side} | {fmt(r.detection_s, 3)} | {fmt(r.downtime_s)} | "
                f"{fmt(r.lost_steps)} | {fmt(r.resumed_from)} | {fmt(r.restart_s)} |"
            )
    print(f"\nhang (rank 1 SIGSTOPped): torchrun: {tr_hang}; supervisor: {sup_hang}")


if __name__ == "__main__":
    main()
