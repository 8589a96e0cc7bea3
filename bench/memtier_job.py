"""The job part of bench/memtier.py (`--job SECONDS`): the memory tier's cost in the real job.

The supervisor's `python -m supervisor run` of the debug preset on this host, 2 ranks on
mpiexec (both training, OMP_NUM_THREADS=1), a durable save every 10 steps, standby off (the
tier alone is measured), runs of a fixed wall time, stopped with SIGINT: `mem_ckpt_interval = 1`
(a copy after every step) and the tier off, interleaved (on, off, on, off, ...). From rank 0's
metrics, after the warm-up (the steps before WARM: imports, the slots faulted in): steps per
second (record to record: the step and what the loop does between steps, the durable saves
alike in both), and the median period between two records. The ratio on/off of each pair, and
of their means. The host's other load moves both: read the pairs, not one run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARM = 10  # the first record counted
CONFIG = """[job]
name = "memtier"
[launch]
launcher = "mpiexec"
ranks_per_node = 2
env = {{ OMP_NUM_THREADS = "1" }}
[worker]
model = "debug"
device = "cpu"
train_iters = 100000
save_interval = 10
mem_ckpt_interval = {interval}
[restart]
standby = false
"""


def one_run(root: Path, interval: int, seconds: int, workdir: Path, env: dict) -> dict:
    """One supervised run of `seconds`, stopped as Ctrl-C stops it; its figures."""
    config = workdir / f"memtier-{interval}.toml"
    config.write_text(CONFIG.format(interval=interval))
    run_dir = workdir / f"run-{interval}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "supervisor", "run", str(config)]
    cmd += ["--set", f"job.run_dir={run_dir}", "--quiet", "--no-report"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    metrics = run_dir / "attempts" / "000" / "metrics-0.jsonl"
    if not metrics.exists():
        raise RuntimeError(f"no metrics from the supervised run ({proc.returncode}):\n{err}")
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return figures(records)


def figures(records: list[dict]) -> dict:
    """Pure: steps per second and the median period after WARM, and the tier's medians."""
    warm = [r for r in records if r["step"] >= WARM]
    if len(warm) < 3:
        raise RuntimeError(f"too few steps to count ({len(records)} records)")
    by_step = {r["step"]: r for r in records}
    periods = [r["t"] - by_step[r["step"] - 1]["t"] for r in warm[1:] if r["step"] - 1 in by_step]
    out = {
        "steps": records[-1]["step"],
        "rate": (warm[-1]["step"] - warm[0]["step"]) / (warm[-1]["t"] - warm[0]["t"]),
        "period_s": statistics.median(periods),
    }
    for key in ("stall", "copy", "check"):
        values = [r[f"train/mem_ckpt_{key}_seconds"] for r in warm
                  if f"train/mem_ckpt_{key}_seconds" in r]  # fmt: skip
        out[f"{key}_s"] = statistics.median(values) if values else None
    return out


def job_main(root: Path, seconds: int, pairs: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    work = Path(tempfile.mkdtemp(prefix="bench-memtier-job-"))
    rows = []
    try:
        for n in range(pairs):
            on = one_run(root, 1, seconds, work, env)
            off = one_run(root, 0, seconds, work, env)
            rows.append((on, off))
            ms = {k: f"{on[k] * 1e3:.1f}" if on[k] is not None else "-"
                  for k in ("stall_s", "copy_s", "check_s")}  # fmt: skip
            print(f"pair {n + 1}: on {on['steps']} steps, {on['rate']:.3f}/s, period "
                  f"{on['period_s'] * 1e3:.1f} ms (stall {ms['stall_s']} ms, copy {ms['copy_s']}"
                  f" ms, seal {ms['check_s']} ms) | off {off['steps']} steps, {off['rate']:.3f}/s,"
                  f" period {off['period_s'] * 1e3:.1f} ms | steps/s on/off "
                  f"{on['rate'] / off['rate']:.3f}, period off/on "
                  f"{off['period_s'] / on['period_s']:.3f}", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = statistics.mean(a["rate"] for a, _ in rows) / statistics.mean(b["rate"] for _, b in rows)
    period = statistics.median(b["period_s"] / a["period_s"] for a, b in rows)
    print(
        f"job, {pairs} pair(s) of {seconds} s: steps/s on/off {rate:.3f} (means), "
        f"period off/on {period:.3f} (median of pairs); goal >= 0.98",
        flush=True,
    )
