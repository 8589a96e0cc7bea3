"""torchrun's side of `bench/soak.py`: the same worker and flags under `torchrun --standalone
--max-restarts`, the trace given from outside by signals to the ranks (found in torchrun's
process tree), and what torchrun's log and rank 0's metrics say of each failure.

A failure is given at its time once the job trains (a step recorded since the last failure that
ended an attempt), as the project's fault engine waits; one that cannot be given by then is not
given. Kinds torchrun cannot be given as such are approximated or left out
(`soak_trace.TORCHRUN_GIVEN`). Detection is torchrun's own log line saying a worker failed
(`vs_torchrun.notice_times`); where each resume came from is the worker's `RESUMED from` line.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import psutil
import soak_run
from soak_figures import after_failures
from soak_run import Fired, Outcome
from soak_trace import DISRUPTIVE, SLOW_DELAY_S, SLOW_DURATION_S, TORCHRUN_GIVEN, Fault, Shape
from vs_torchrun import env, notice_times, rank_pids, records

from supervisor.settings import config as config_mod

REPO = Path(__file__).resolve().parents[1]
RESUMED = re.compile(r"RESUMED from step=(\d+) \((memory|partner)?")
MAX_RESTARTS = 1000


def run(trace: list[Fault], *, shape: Shape, flags: dict, duration_s: float, tmp: Path) -> Outcome:
    """One window of torchrun on one host, `shape.world` ranks; `trace` empty for the clean
    run."""
    world = shape.world
    out, mem = tmp / "out", soak_run.mem_root("tr")
    flags = {**flags, "ckpt_dir": str(tmp / "ckpt"), "outdir": str(out)}
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(world), "--max-restarts",
           str(MAX_RESTARTS), "-m", "worker.train"]  # fmt: skip
    cmd += config_mod.flags_from_table(flags)
    e = env()
    e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as vs_torchrun: pytorch/pytorch#135712
    e["ES_MEM_ROOT"] = str(mem)
    result = Outcome("torchrun", clean=not trace, world=world)
    log_path = tmp / "torchrun.log"
    metrics = out / "metrics-0.jsonl"
    started = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            first = soak_run.wait_first_step(lambda: records(metrics), proc)
            result.t0, result.startup_s = first["t"], first["t"] - started
            end = result.t0 + duration_s
            giver = Giver(proc, metrics, mem, shape, result.t0, end)
            result.fired = [giver.give(f) for f in trace]
            result.ended = soak_run.sleep_until(end + 1.0, proc)
            giver.done.set()
        finally:
            soak_run.stop(proc, terms=1)
            soak_run.drop_mem_root(mem)
    result.records = with_attempts(records(metrics))
    result.rows = failure_rows(result, log_path.read_text(errors="replace"))
    result.resumes = [(r["attempt"], r["step"] - 1) for r in result.records
                      if r["attempt"] > 0 and "train/startup_seconds" in r]  # fmt: skip
    return result


class Giver:
    """Gives the trace's failures to torchrun's ranks, one at a time, each once the job
    trains again after the last one that ended an attempt."""

    def __init__(self, proc, metrics: Path, mem: Path, shape: Shape, t0: float, end: float):
        self.proc, self.metrics, self.mem, self.shape = proc, metrics, mem, shape
        self.t0, self.end = t0, end
        self.since = t0 - 1.0  # the last failure that ended an attempt (the first step trains)
        self.done = threading.Event()  # ends a slow-down in progress

    def give(self, f: Fault) -> Fired:
        if f.kind == "nan":
            return Fired(f, None, TORCHRUN_GIVEN["nan"])
        due = self.t0 + f.at_s
        while time.time() < self.end and self.proc.poll() is None:
            if time.time() >= due and self.trains():
                pids = rank_pids(self.proc.pid)
                if len(pids) == self.shape.world:
                    return self.act(f, pids)
            time.sleep(soak_run.POLL_S)
        return Fired(f, None, "not given: the window ended first")

    def trains(self) -> bool:
        return any(r["t"] > self.since for r in records(self.metrics))

    def act(self, f: Fault, pids: dict[int, int]) -> Fired:
        now = time.time()
        if f.kind == "kill":
            for pid in pids.values():
                _signal(pid, signal.SIGKILL)
        elif f.kind == "kill_rank":
            _signal(pids[f.target], signal.SIGKILL)
        elif f.kind == "node_loss":  # the node's ranks and their memory
            per = self.shape.ranks_per_node
            for rank in range(f.target * per, (f.target + 1) * per):
                _signal(pids[rank], signal.SIGKILL)
                for held in self.mem.glob(f"es-mem-*/rank-{rank}"):
                    shutil.rmtree(held, ignore_errors=True)
        elif f.kind in ("hang", "stall"):
            _signal(pids[f.target], signal.SIGSTOP)
        elif f.kind == "slow":
            step = _recent_step(records(self.metrics))
            threading.Thread(target=self.slow, args=(pids[f.target], step), daemon=True).start()
        if f.kind in DISRUPTIVE:
            self.since = now
            self.done.set()  # a slow-down ends with its attempt
            self.done = threading.Event()
        return Fired(f, now, TORCHRUN_GIVEN[f.kind])

    def slow(self, pid: int, step_s: float) -> None:
        """The rank stopped SLOW_DELAY_S after every step's time, for SLOW_DURATION_S."""
        done, until = self.done, time.time() + SLOW_DURATION_S
        try:
            p = psutil.Process(pid)
            while time.time() < until and not done.wait(step_s):
                p.suspend()
                time.sleep(SLOW_DELAY_S)
                p.resume()
        except psutil.Error:
            pass


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _recent_step(recs: list[dict]) -> float:
    dts = sorted(r["train/dt"] for r in recs[-10:] if "train/dt" in r)
    return dts[len(dts) // 2] if dts else 0.4


def with_attempts(recs: list[dict]) -> list[dict]:
    """Rank 0's records, each with its attempt: torchrun appends every restart's to one file,
    and each start's first record carries `train/startup_seconds`."""
    out, attempt = [], -1
    for r in recs:
        if "train/startup_seconds" in r or attempt < 0:
            attempt += 1
        out.append({**r, "attempt": attempt})
    return out


def failure_rows(result: Outcome, log: str) -> list[dict]:
    """Per failure that ended an attempt: detection (torchrun's first line saying a worker
    failed), downtime, lost steps and the resume's source; the others: when they were given."""
    given = [x for x in result.fired if x.wall is not None]
    ends = [x for x in given if x.fault.kind in DISRUPTIVE]
    noticed = notice_times(log, datetime.fromtimestamp(ends[0].wall)) if ends else []
    starts = after_failures(result.records, [x.wall for x in ends])
    after = dict(zip([x.fault.index for x in ends], starts, strict=True))
    resumes = [(int(m.group(1)), m.group(2) or "durable") for m in RESUMED.finditer(log)]
    rows = []
    for x in given:
        row = {"index": x.fault.index, "kind": x.fault.kind, "at_s": x.wall - result.t0,
               "relaunch": None, "source": None}  # fmt: skip
        if x.fault.index in after:
            got = after[x.fault.index]
            row.update(
                detection_s=next((t - x.wall for t in noticed if t >= x.wall), None),
                downtime_s=got.get("downtime_s"), lost=got.get("lost"),
                relaunch="cold" if got else None,
                source=_source(resumes, got.get("resumed")),
            )  # fmt: skip
        rows.append(row)
    return rows


def _source(resumes: list[tuple[int, str]], step: int | None) -> str | None:
    """The source of the first unused `RESUMED from` line of this step (used up)."""
    for i, (s, source) in enumerate(resumes):
        if s == step:
            del resumes[i]
            return source
    return None
