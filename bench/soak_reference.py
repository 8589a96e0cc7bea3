"""The losses a run with skipped batches must match, for `bench/soak.py`'s bit-exact check.

A `nan` makes the numerical guard drop that step's batch and redo the step with the next one:
from then on the run is bit-identical to one given `--skip-batches P-P`, not to the clean run
(docs/worker.md, "Numerical guard"). This runs the worker alone under `mpiexec`, with the job's
own resolved `[worker]` flags (read back from its run directory) and those positions skipped,
until it has done the steps to compare. Checkpoints are left out: they change no loss.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import soak_run
from vs_torchrun import env, records

from supervisor.settings import config as config_mod

REPO = Path(__file__).resolve().parents[1]
OFF = {"save_interval": 0, "mem_ckpt_interval": 0, "async_ckpt": False, "save_on_exit": False}
TIMEOUT_S = 1800


def losses(run_dir: Path, world: int, skip: list[int], upto: int, tmp: Path) -> dict[int, object]:
    """step -> rank 0's loss, steps 1..upto, of the job's worker with `skip` positions skipped."""
    worker = tomllib.loads((run_dir / "config.toml").read_text())["worker"]
    module = worker.pop("module", "worker.train")
    ranges = [r for r in str(worker.pop("skip_batches", "")).split(",") if r]
    ranges += [f"{p}-{p}" for p in skip]
    flags = {**worker, **OFF, "ckpt_dir": str(tmp / "ckpt"), "outdir": str(tmp / "out"),
             "skip_batches": ",".join(ranges)}  # fmt: skip
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    cmd = [mpiexec, "-n", str(world), sys.executable, "-m", module,
           *config_mod.flags_from_table(flags)]  # fmt: skip
    metrics = tmp / "out" / "metrics-0.jsonl"
    tmp.mkdir(parents=True, exist_ok=True)
    with (tmp / "reference.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                got = records(metrics)
                if got and got[-1]["step"] >= upto:
                    break
                time.sleep(0.5)
        finally:
            soak_run.stop(proc, terms=1, grace_s=5)
    return {r["step"]: r["loss"] for r in records(metrics)}
