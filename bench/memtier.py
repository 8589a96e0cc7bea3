"""The memory checkpoint tier: its per-step stall against the memcpy floor, its load against memcpy.

    python bench/memtier.py                 # the debug preset and a ~250M model (a few minutes)
    python bench/memtier.py --size debug    # quick (about a minute)
    python bench/memtier.py --job 60 --pairs 2   # the real job under the supervisor, on/off

Per size, in one run, everything on this host:
- real worker runs (`python -m worker.train` under mpiexec, `--ranks` ranks, default 1, so a
  core of this 2-core host is left to the copy thread, as a GPU node has one; OMP_NUM_THREADS=1):
  one with `--mem-ckpt-interval 1` (a copy after every step) and a baseline without the tier.
  From rank 0's metrics: `train/mem_ckpt_stall_seconds` (what the loop blocked before the
  optimizer step), `train/mem_ckpt_copy_seconds` (the copy with its page sums, beside the
  forward and backward at the lowest priority: from its start to its last piece, its waits for
  idle CPU included), `train/mem_ckpt_check_seconds` (the seal after the copy: the digests
  from those sums and the record, not waited for) and `train/dt`;
  and the gap between two steps' records not inside either step (where the loop hands the state
  to the copy thread: `MemoryTier.save`), against the baseline's. The first copy
  into each of the two slots maps and faults the slot in: shown apart; the warm copies' median
  counts.
- in-process (this file re-runs itself as one process, a gloo world of 1, the model built with
  the worker's own code as bench/ckpt.py does, one real training step for the Adam moments): the
  memcpy floor, a plain torch `copy_` of the slot's bytes between two pre-faulted host buffers
  (best of 5); the tier's own copy with nothing beside it (`save` + `wait_copied`, warm slots,
  best of 3) and the `save` call itself (the hand-over); the page sums' share of the copy (the
  checksum's pass over the data, each piece summed right after its copy); the seal the copy
  thread makes after each copy (the digests from the sums, the record; not waited for); the
  load of a slot: `memory.read_into` (the read path: each piece checked as it is read), the
  same bytes read unchecked (the path before the checksums, for comparison in the same run) and
  the whole `MemoryTier.load` (state dict plumbing, scheduler, RNG), best of 3 each, in GB/s
  against the floor's GB/s.
With `--ranks 2` the floor is taken for half the bytes (FSDP's per-rank share, approximately)
and still one copy at a time, where the two ranks copy at once: read it as a rough floor.

With `--job SECONDS` only the cost in the real job is measured (bench/memtier_job.py): the
supervisor's run of the debug preset on 2 ranks, both training, a copy after every step against
the tier off, runs of SECONDS interleaved, `--pairs` pairs; steps per second on/off. Its goal:
at least 0.98 (the tier costs at most 2 % of a step).

Goals: the warm stall <= 1.2x the floor, or <= 0.05x the step (the copy overlapping the step);
the load >= 0.7x memcpy. `ES_MEM_ROOT` is a fresh directory under /dev/shm, removed at the end.
The 2 cores and the memory bus are shared with whatever else runs: repeat a run before trusting
a small difference.
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The in-process part, beside this script (a script's folder is on sys.path).
from memtier_inproc import MODELS, RESULT, inproc_main  # noqa: E402
from memtier_job import job_main  # noqa: E402

# worker steps: (with the tier, baseline). With a copy after every step, the record of step n
# carries the copy of step n-1; steps 2 and 3 carry the first copy into each slot.
STEPS = {"debug": (12, 8), "250m": (8, 4)}
FIRST_WARM = 4  # the first record with a warm copy
GOAL_STALL_FLOOR, GOAL_STALL_STEP, GOAL_LOAD = 1.2, 0.05, 0.7


def mpiexec() -> str:
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"


def child_env(mem_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ES_MEM_ROOT=str(mem_root))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_inproc(size: str, workdir: Path, ranks: int, mem_root: Path) -> dict:
    cmd = [sys.executable, __file__, "--role", "inproc", "--size", size]
    cmd += ["--dir", str(workdir), "--ranks", str(ranks)]
    done = subprocess.run(
        cmd, env=child_env(mem_root), capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"in-process part failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


# ---- real worker runs ---------------------------------------------------------------------------
def launch_worker(size: str, flags: list[str], outdir: Path, ranks: int, mem_root: Path):
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "worker.train", *MODELS[size]]
    cmd += [*flags, "--outdir", str(outdir), "--log-every", "1000"]
    done = subprocess.run(
        cmd, env=child_env(mem_root), capture_output=True, text=True, timeout=1200, cwd=ROOT
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    records = [json.loads(x) for x in (outdir / "metrics-0.jsonl").read_text().splitlines()]
    return records, done.stdout


def gaps(records: list[dict], first: int) -> list[float]:
    """Seconds between two steps' records outside the later step (the loop's work between
    steps: the checkpoint calls), for records of step >= `first`."""
    by_step = {r["step"]: r for r in records}
    return [
        r["t"] - by_step[r["step"] - 1]["t"] - r["train/dt"]
        for r in records
        if r["step"] >= first and r["step"] - 1 in by_step
    ]


def worker_runs(size: str, workdir: Path, ranks: int, mem_root: Path) -> dict:
    steps, base_steps = STEPS[size]
    out: dict[str, float] = {}
    ckpt = workdir / "ckpt"
    flags = ["--train-iters", str(steps), "--ckpt-dir", str(ckpt), "--mem-ckpt-interval", "1"]
    flags += ["--no-save-on-exit", "--no-resume"]
    records, stdout = launch_worker(size, flags, workdir / "w-mem", ranks, mem_root)
    if "memory tier off" in stdout:
        raise RuntimeError(f"the worker turned the memory tier off:\n{stdout}")
    with_copy = [r for r in records if "train/mem_ckpt_stall_seconds" in r]
    warm = [r for r in with_copy if r["step"] >= FIRST_WARM]
    cold = [r for r in with_copy if r["step"] < FIRST_WARM]
    if not warm:
        raise RuntimeError(f"no warm copy in the worker's metrics ({len(records)} records)")
    out["copies"] = len(warm)
    out["stall_s"] = statistics.median(r["train/mem_ckpt_stall_seconds"] for r in warm)
    out["stall_max_s"] = max(r["train/mem_ckpt_stall_seconds"] for r in warm)
    out["copy_s"] = statistics.median(r["train/mem_ckpt_copy_seconds"] for r in warm)
    checked = [r["train/mem_ckpt_check_seconds"] for r in records
               if r["step"] >= FIRST_WARM and "train/mem_ckpt_check_seconds" in r]  # fmt: skip
    out["worker_check_s"] = statistics.median(checked) if checked else float("nan")
    out["first_stall_s"] = max((r["train/mem_ckpt_stall_seconds"] for r in cold), default=0.0)
    out["first_copy_s"] = max((r["train/mem_ckpt_copy_seconds"] for r in cold), default=0.0)
    out["step_s"] = statistics.median(r["train/dt"] for r in warm)
    out["gap_s"] = statistics.median(gaps(records, FIRST_WARM))
    base, _ = launch_worker(size, ["--train-iters", str(base_steps)], workdir / "w-base", ranks,
                            mem_root)  # fmt: skip
    out["base_step_s"] = statistics.median(r["train/dt"] for r in base[1:])
    out["base_gap_s"] = statistics.median(gaps(base, 2))
    out["left_in_root"] = len(list(mem_root.iterdir()))
    return out


# ---- the table ----------------------------------------------------------------------------------
def table(size: str, r: dict, ranks: int) -> tuple[str, dict[str, bool]]:
    gb = r["nbytes"] / 1e9
    floor = r["floor_share_s"] if ranks > 1 else r["floor_s"]
    share = f" (the per-rank share, {gb / ranks:.3f} GB)" if ranks > 1 else ""
    floor_gbs = r["nbytes"] / r["floor_s"] / 1e9
    stall_floor, stall_step = r["stall_s"] / floor, r["stall_s"] / r["step_s"]
    stall_ok = stall_floor <= GOAL_STALL_FLOOR or stall_step <= GOAL_STALL_STEP
    # The loop also blocks in `MemoryTier.save` (state dict, meta, hand-over), between steps:
    # the worker's own figure is the between-step gap beyond the baseline's.
    blocked = r["stall_s"] + max(0.0, r["gap_s"] - r["base_gap_s"])
    blocked_ok = blocked / floor <= GOAL_STALL_FLOOR or blocked / r["step_s"] <= GOAL_STALL_STEP
    read_gbs = r["read_bytes"] / r["read_s"] / 1e9
    plain_gbs = r["read_bytes"] / r["plain_read_s"] / 1e9
    load_gbs = r["read_bytes"] / r["load_s"] / 1e9
    read_ok = read_gbs / floor_gbs >= GOAL_LOAD
    load_ok = load_gbs / floor_gbs >= GOAL_LOAD

    def met(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    rows = [
        ("model", f"{r['params'] / 1e6:.0f}M params, {ranks} rank(s)"),
        ("slot (params + 2 moments, fp32, one rank of 1)", f"{gb:.3f} GB"),
        (
            f"memcpy floor{share}",
            f"{floor * 1e3:8.1f} ms  ({floor_gbs:.2f} GB/s, best of 5)",
        ),
        ("in-process: the tier's copy alone (warm)", f"{r['copy_alone_s'] * 1e3:8.1f} ms  "
         f"= {r['copy_alone_s'] / r['floor_s']:.2f}x floor"),
        ("in-process:   of it, the page sums (the checksum's pass)", f"{r['sum_s'] * 1e3:8.1f} ms"
         f"  = {r['sum_s'] / r['floor_s']:.2f}x floor ({gb / r['sum_s']:.2f} GB/s)"),
        ("in-process: first copy into a slot (faults it)",
         f"{r['inproc_first_copy_s'] * 1e3:8.1f} ms"),
        ("in-process: save() call, the hand-over", f"{r['handover_s'] * 1e3:8.1f} ms"),
        ("in-process: seal after the copy (digests, record)", f"{r['check_s'] * 1e3:8.1f} ms  "
         f"= {r['check_s'] / r['floor_s']:.2f}x floor (copy thread, not waited for)"),
        ("worker: step (train/dt), tier on / off", f"{r['step_s'] * 1e3:8.1f} ms / "
         f"{r['base_step_s'] * 1e3:.1f} ms = {r['step_s'] / r['base_step_s']:.2f}x"),
        ("worker: copy beside training (median)", f"{r['copy_s'] * 1e3:8.1f} ms  "
         f"= {r['copy_s'] / floor:.2f}x floor"),
        ("worker: seal after the copy (median)", f"{r['worker_check_s'] * 1e3:8.1f} ms  "
         f"= {r['worker_check_s'] / floor:.2f}x floor (copy thread, not waited for)"),
        ("worker: first copies (slot faulted in): copy / stall",
         f"{r['first_copy_s'] * 1e3:8.1f} ms / {r['first_stall_s'] * 1e3:.1f} ms"),
        ("worker: between-step gap, tier on / off", f"{r['gap_s'] * 1e3:8.1f} ms / "
         f"{r['base_gap_s'] * 1e3:.1f} ms"),
        (f"worker: STALL per step (median of {r['copies']}, max)",
         f"{r['stall_s'] * 1e3:8.3f} ms  (max {r['stall_max_s'] * 1e3:.3f} ms)"),
        ("  stall / floor   (goal <= 1.2x)", f"{stall_floor:8.3f}x"),
        ("  stall / step    (goal <= 0.05x)", f"{stall_step:8.4f}x"),
        ("  stall goal (either)", f"{met(stall_ok):>8}"),
        ("worker: blocked per step, stall + hand-over (gap)", f"{blocked * 1e3:8.3f} ms  "
         f"= {blocked / floor:.3f}x floor, {blocked / r['step_s']:.4f}x step: "
         f"{met(blocked_ok)} (not in the stall metric)"),
        ("LOAD: memory.read_into (the read path)", f"{r['read_s'] * 1e3:8.1f} ms  "
         f"{read_gbs:.2f} GB/s = {read_gbs / floor_gbs:.2f}x memcpy  {met(read_ok)} (>= 0.7x)"),
        ("  each of 3 (ms)", " ".join(f"{x * 1e3:.1f}" for x in r["reads"])),
        ("  the same read unchecked (before checksums)", f"{r['plain_read_s'] * 1e3:8.1f} ms  "
         f"{plain_gbs:.2f} GB/s = {plain_gbs / floor_gbs:.2f}x memcpy"),
        ("  each of 3 (ms)", " ".join(f"{x * 1e3:.1f}" for x in r["plain_reads"])),
        ("  CPU time (not lost to others): floor / read / unchecked",
         f"{r['floor_cpu_s'] * 1e3:8.1f} ms / {r['read_cpu_s'] * 1e3:.1f} ms "
         f"({r['floor_cpu_s'] / r['read_cpu_s']:.2f}x) / {r['plain_read_cpu_s'] * 1e3:.1f} ms "
         f"({r['floor_cpu_s'] / r['plain_read_cpu_s']:.2f}x)"),
        ("LOAD: MemoryTier.load (whole)", f"{r['load_s'] * 1e3:8.1f} ms  "
         f"{load_gbs:.2f} GB/s = {load_gbs / floor_gbs:.2f}x memcpy  {met(load_ok)} (>= 0.7x)"),
        ("  each of 3 (ms)", " ".join(f"{x * 1e3:.1f}" for x in r["loads"])),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"== {size} =="] + [f"{k.ljust(width)}  {v}" for k, v in rows]
    if r["left_in_root"] or r["inproc_left_in_root"]:
        lines.append(f"NOTE: files left under ES_MEM_ROOT after a clean exit: {r}")
    goals = {
        "stall <= 1.2x floor or <= 0.05x step": stall_ok,
        "load via memory.read_into >= 0.7x memcpy": read_ok,
        "load via MemoryTier.load >= 0.7x memcpy": load_ok,
    }
    return "\n".join(lines), goals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="debug,250m", help="comma list: debug, 250m")
    p.add_argument("--ranks", type=int, default=1, help="worker ranks (default 1)")
    p.add_argument(
        "--job",
        type=int,
        default=0,
        metavar="SECONDS",
        help="only the real job under the supervisor: runs of SECONDS, on/off",
    )
    p.add_argument("--pairs", type=int, default=2, help="with --job: on/off pairs (default 2)")
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [s.strip() for s in a.size.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in MODELS]
    if unknown:
        p.error(f"unknown size(s) {unknown}: choose from {', '.join(MODELS)}")
    if a.role == "inproc":
        inproc_main(sizes[0], Path(a.dir), a.ranks)
        return 0
    if a.job:
        job_main(ROOT, a.job, a.pairs)
        return 0
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    mem_root = Path(tempfile.mkdtemp(prefix="bench-memtier-", dir=shm))
    work = Path(tempfile.mkdtemp(prefix="bench-memtier-"))
    print(f"ES_MEM_ROOT={mem_root}", flush=True)
    verdicts: list[tuple[str, str, bool]] = []
    try:
        for size in sizes:
            started = time.monotonic()
            inproc = run_inproc(size, work / f"{size}-inproc", a.ranks, mem_root)
            r = worker_runs(size, work / size, a.ranks, mem_root)
            r.update({k: v for k, v in inproc.items() if k not in ("first_copy_s", "left_in_root")})
            r["inproc_first_copy_s"] = inproc["first_copy_s"]
            r["inproc_left_in_root"] = inproc["left_in_root"]
            text, ok = table(size, r, a.ranks)
            verdicts += [(size, goal, met) for goal, met in ok.items()]
            print(f"{text}\n({time.monotonic() - started:.0f} s)\n", flush=True)
    finally:
        shutil.rmtree(mem_root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print("goals:")
    for size, goal, ok in verdicts:
        print(f"  {size:>6}  {goal:<42}  {'MET' if ok else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
