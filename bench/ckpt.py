"""Checkpoint save/load against the disk's raw bandwidth, the restart floor, and async costs.

    python bench/ckpt.py                      # ~300 MB and ~3 GB of state, sync only
    python bench/ckpt.py --async              # ... plus the async figures
    python bench/ckpt.py --sizes 300 --async  # quick

Per size, in one run, on 2 ranks (FSDP, CPU/gloo; `--ranks 1` runs one, leaving this 2-core
host a core for the background saving, as a GPU node has):
- in-process, under `mpiexec -n 2` (this file re-launches itself with `--role ranks`): raw
  sequential write with fsync and cold raw read of the same directory (both ranks at once; reads
  and loads: the median of 5, interleaved; also a raw read of the saved shard files), the memcpy
  floor, sync save (`Checkpointer.save`) and cold load (`Checkpointer.load`), the
  optimizer-state preparation for a load (`prefill_adamw_state` against a dummy step), and with
  `--async`: the async stage stall (a second save, buffers warm: the save call plus the wait
  before the next optimizer step, the copy running beside that step's forward and backward), the
  readiness check's cost per step while a save is in flight, the drain (finalize) stall and the
  time from save to marker;
- real worker launches (`python -m worker.train`): the restart floor (the resumed run's
  `startup/*` parts) and, with `--async`, the effective cost per save: wall-clock of a run with
  saves minus the same run without, over the number of saves, for sync and async, and the I/O
  floor: the same for a run without saves while another process writes and fsyncs as many
  bytes at the same cadence (each variant twice, interleaved; the shortest run counts).
"Cold" reads evict the files from the page cache first (POSIX_FADV_DONTNEED). The disk and the
2 cores are shared with whatever else runs: repeat a run before trusting a small difference.
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# What the ranks measure, beside this script (a script's folder is on sys.path).
from ckpt_ranks import COMMON, RESULT, SIZES, ranks_main  # noqa: E402

# worker runs for the effective cost: (steps, save interval) per size
WALL_RUNS = {300: (16, 2), 3000: (8, 2)}
WALL_REPS = 2


# ---- helpers ---------------------------------------------------------------------------------
def mpiexec() -> str:
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"


def rank_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


# ---- the orchestrating part ------------------------------------------------------------------
def run_ranks(size: int, workdir: Path, with_async: bool, ranks: int) -> dict:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, __file__, "--role", "ranks"]
    cmd += ["--sizes", str(size), "--dir", str(workdir)] + (["--async"] if with_async else [])
    done = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=3600)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"ranks failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


class PlainWrites(threading.Thread):
    """The I/O floor of a save on this host: the same bytes written and fsynced at the save
    cadence by another process, with no checkpoint code at all, while the worker trains. What
    this costs the worker no async path can avoid (here the virtual disk's writes slow the
    vCPUs' compute)."""

    def __init__(self, metrics: Path, target: Path, nbytes: int, period: float, count: int):
        super().__init__(daemon=True)
        self.metrics, self.target = metrics, target
        self.nbytes, self.period, self.count = nbytes, period, count

    def run(self) -> None:
        while not (self.metrics.exists() and self.metrics.stat().st_size):
            time.sleep(0.02)  # the cadence starts at the end of the first step, as saves do
        start = time.monotonic()
        chunk = bytes(64 << 20)
        for i in range(self.count):
            time.sleep(max(0.0, start + (i + 1) * self.period - time.monotonic()))
            with self.target.open("wb") as f:
                for off in range(0, self.nbytes, len(chunk)):
                    f.write(chunk[: min(len(chunk), self.nbytes - off)])
                f.flush()
                os.fsync(f.fileno())
        self.target.unlink(missing_ok=True)


def launch_worker(
    flags: list[str], outdir: Path, ranks: int, beside: PlainWrites | None = None
) -> tuple[list[dict], float]:
    """A real worker run; returns rank 0's metrics and the seconds from the end of its first
    step to the launcher's exit (saves, the final drain and teardown included; start-up
    excluded)."""
    shutil.rmtree(outdir, ignore_errors=True)
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "worker.train", *flags]
    if beside is not None:
        beside.start()
    done = subprocess.run(
        [*cmd, "--outdir", str(outdir)],
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=ROOT,
    )
    ended = time.time()
    if beside is not None:
        beside.join()
    if done.returncode != 0:
        raise RuntimeError(f"worker failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    records = [json.loads(x) for x in (outdir / "metrics-0.jsonl").read_text().splitlines()]
    return records, ended - records[0]["t"]


def worker_runs(
    size: int, workdir: Path, with_async: bool, steps: int, interval: int, nbytes: int, ranks: int
) -> dict:
    """Wall-clock runs, each variant WALL_REPS times interleaved; the least disturbed (the
    shortest) run of each counts."""
    model = [*SIZES[size], *COMMON, "--train-iters", str(steps), "--no-save-on-exit"]
    out: dict[str, float] = {}
    saves = steps // interval
    ckpt = workdir / "wckpt"
    variants = {"none": []}
    variants["sync"] = ["--ckpt-dir", str(ckpt), "--save-interval", str(interval), "--no-resume"]
    if with_async:
        variants["async"] = [*variants["sync"], "--async-ckpt"]
        variants["io-floor"] = []
    walls: dict[str, float] = {}
    runs = [name for _ in range(WALL_REPS) for name in variants]
    for name in runs:
        outdir = workdir / f"w-{name}"
        beside = None
        if name == "io-floor":
            period = out["none_step_s"] * interval
            beside = PlainWrites(
                outdir / "metrics-0.jsonl", workdir / "plain", nbytes, period, saves
            )
        records, wall = launch_worker([*model, *variants[name]], outdir, ranks, beside)
        if name in walls and wall >= walls[name]:
            continue
        walls[name] = wall
        out[f"{name}_wall_s"] = wall
        # Steady state: from the first step's end to the last step's, so the final save (and
        # an async run's wait for it before exit) is left out; saves - 1 fall in that window.
        out[f"{name}_window_s"] = records[-1]["t"] - records[0]["t"]
        out[f"{name}_step_s"] = statistics.median(r["train/dt"] for r in records[1:])
        if name == "async":
            marks = [
                r["train/ckpt_marker_seconds"] for r in records if "train/ckpt_marker_seconds" in r
            ]
            out["worker_save_to_marker_s"] = statistics.median(marks) if marks else float("nan")
            stalls = [
                r["train/ckpt_stage_seconds"] for r in records if "train/ckpt_stage_seconds" in r
            ]
            out["worker_async_stall_s"] = statistics.median(stalls)
        if name == "sync":
            stalls = [
                r["train/ckpt_save_seconds"] for r in records if "train/ckpt_save_seconds" in r
            ]
            out["worker_sync_stall_s"] = statistics.median(stalls)
    for name in variants:
        if name != "none":
            key = name.replace("-", "_")
            out[f"{key}_effective_s"] = (walls[name] - walls["none"]) / saves
            steady = out[f"{name}_window_s"] - out["none_window_s"]
            out[f"{key}_steady_s"] = steady / (saves - 1)
    # Restart floor: resume the last complete checkpoint and run one step.
    resumed, _ = launch_worker(
        [*SIZES[size], *COMMON, "--train-iters", str(steps + 1), "--ckpt-dir", str(ckpt)],
        workdir / "w-restart",
        ranks,
    )
    first = resumed[0]
    from worker.startup import PARTS

    for key in PARTS:
        out[f"startup_{key}_s"] = first.get(f"startup/{key}", float("nan"))
    out["restart_s"] = first.get("train/restart_seconds", float("nan"))
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def table(size: int, r: dict, with_async: bool, ranks: int) -> str:
    gb = r["state_bytes"] / 1e9

    def bw(seconds: float) -> str:
        return f"{gb / seconds:6.2f} GB/s"

    rows = [
        (f"state (params + 2 moments, {ranks} ranks)", f"{gb:.2f} GB"),
        ("raw write + fsync", f"{r['raw_write_s']:7.2f} s  {bw(r['raw_write_s'])}"),
        ("raw read (cold)", f"{r['raw_read_s']:7.2f} s  {bw(r['raw_read_s'])}"),
        (
            "sync save (DCP)",
            f"{r['sync_save_s']:7.2f} s  {bw(r['sync_save_s'])}  "
            f"{r['raw_write_s'] / r['sync_save_s']:.0%} of raw",
        ),
        (
            "load (DCP, cold)",
            f"{r['load_s']:7.2f} s  {bw(r['load_s'])}  {r['raw_read_s'] / r['load_s']:.0%} of raw",
        ),
        (
            "raw read of the loaded shard files (cold)",
            f"{r['shard_read_s']:7.2f} s  load at {r['shard_read_s'] / r['load_s']:.0%} of it",
        ),
        ("optimizer prep: prefill_adamw_state", f"{r['prefill_s'] * 1e3:7.1f} ms"),
        ("optimizer prep: dummy step", f"{r['dummy_step_s'] * 1e3:7.1f} ms"),
        ("memcpy floor (staged bytes, per rank)", f"{r['memcpy_s'] * 1e3:7.1f} ms"),
    ]
    from worker.startup import PARTS

    for key in PARTS:
        rows.append((f"restart floor: {key}", f"{r[f'startup_{key}_s']:7.2f} s"))
    rows.append(("restart floor: total (train/restart_seconds)", f"{r['restart_s']:7.2f} s"))
    if with_async:
        sync = r["sync_save_s"]
        rows += [
            ("async stage stall, 1st save (allocates)", f"{r['async_first_stage_s']:7.3f} s"),
            (
                "async stage stall (warm buffers)",
                f"{r['async_stage_s']:7.3f} s  = {r['async_stage_s'] / sync:.3f} x sync stall, "
                f"{r['async_stage_s'] / r['memcpy_s']:.2f} x memcpy floor",
            ),
            *[
                (f"  of which {part}", f"{r[f'async_part_{part}_s']:7.3f} s")
                for part in ("prepare", "describe", "state_dict", "handover", "wait_staged")
            ],
            ("staging copy (beside forward+backward)", f"{r['async_copy_s']:7.3f} s"),
            (
                "forward+backward: alone / beside the copy",
                f"{r['fwd_bwd_s']:7.3f} s / {r['fwd_bwd_staging_s']:.3f} s",
            ),
            ("readiness check per step (in flight)", f"{r['poll_s'] * 1e6:7.0f} us"),
            ("drain (finalize) stall", f"{r['drain_s']:7.3f} s"),
            ("save -> marker", f"{r['save_to_marker_s']:7.2f} s"),
            ("worker: step time (no saves)", f"{r['none_step_s']:7.2f} s"),
            ("worker: sync stall per save", f"{r['worker_sync_stall_s']:7.2f} s"),
            ("worker: async stall per save", f"{r['worker_async_stall_s']:7.3f} s"),
            ("worker: save -> marker", f"{r['worker_save_to_marker_s']:7.2f} s"),
            ("worker: effective cost per save, sync", f"{r['sync_effective_s']:7.2f} s"),
            (
                "worker: effective cost per save, async",
                f"{r['async_effective_s']:7.2f} s  = "
                f"{r['async_effective_s'] / r['sync_effective_s']:.2f} x sync",
            ),
            (
                "worker: I/O floor: the same bytes written beside",
                f"{r['io_floor_effective_s']:7.2f} s  = "
                f"{r['io_floor_effective_s'] / r['sync_effective_s']:.2f} x sync",
            ),
            (
                "  steady state (final save left out): sync",
                f"{r['sync_steady_s']:7.2f} s",
            ),
            (
                "  steady state: async / I/O floor",
                f"{r['async_steady_s']:7.2f} s = {r['async_steady_s'] / r['sync_steady_s']:.2f} x "
                f"sync / {r['io_floor_steady_s']:.2f} s = "
                f"{r['io_floor_steady_s'] / r['sync_steady_s']:.2f} x sync",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    lines = [f"== ~{size} MB of state =="]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="300,3000", help="comma list of MB: 300, 3000")
    p.add_argument("--async", dest="with_async", action="store_true")
    p.add_argument("--dir", default=None, help="where to write (default: a new temp dir)")
    p.add_argument("--steps", type=int, default=None, help="worker steps of the wall-clock runs")
    p.add_argument("--interval", type=int, default=None, help="save interval of those runs")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="ranks per run (default 2; 1 leaves a core of this 2-core host to the saving)",
    )
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.role == "ranks":
        ranks_main(sizes[0], Path(a.dir), a.with_async)
        return 0
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    results = {}
    try:
        for size in sizes:
            work = base / f"s{size}"
            r = run_ranks(size, work, a.with_async, a.ranks)
            shutil.rmtree(work, ignore_errors=True)
            steps, interval = WALL_RUNS[size]
            r.update(
                worker_runs(
                    size,
                    work,
                    a.with_async,
                    a.steps or steps,
                    a.interval or interval,
                    r["state_bytes"],
                    a.ranks,
                )
            )
            shutil.rmtree(work, ignore_errors=True)
            results[size] = r
            print(table(size, r, a.with_async, a.ranks), flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
