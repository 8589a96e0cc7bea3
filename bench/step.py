"""Step time, tokens/s and the start-up breakdown of the worker, per layout and model size.

    python bench/step.py                 # debug preset and a ~250M model, every layout
    python bench/step.py --models debug  # quick

Each cell is one real `mpiexec` launch of `python -m worker.train`; figures come from the
worker's own metrics (rank 0): the median `train/dt` after the first step, and the first
step's `startup/*` parts (interpreter and imports, process group, model build and shard,
checkpoint load, first step). 4-rank layouts on a 2-core machine are oversubscribed: read
them for relative cost, not speed.
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
from pathlib import Path

MODELS = {
    "debug": ["--model", "debug", "--seq-len", "256", "--batch-size", "2"],
    "250m": [
        "--model",
        "debug",
        "--dim",
        "1024",
        "--n-layers",
        "16",
        "--n-heads",
        "16",
        "--n-kv-heads",
        "4",
        "--ffn-dim",
        "2816",
        "--seq-len",
        "128",
        "--batch-size",
        "1",
    ],
}
LAYOUTS = {
    "fsdp-2": (2, []),
    "hsdp-2x2": (4, ["--replicate", "2"]),
    "fsdp+tp-2x2": (4, ["--tp", "2"]),
}
STARTUP = ("imports", "process_group", "model_build", "load", "first_step")


def launch(ranks: int, flags: list[str], steps: int, outdir: Path) -> list[dict]:
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    cmd = [
        mpiexec,
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "worker.train",
        *flags,
        "--train-iters",
        str(steps),
        "--outdir",
        str(outdir),
        "--log-every",
        "1000",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=1800)
    return [json.loads(line) for line in (outdir / "metrics-0.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    head = (
        f"{'model':6} {'layout':12} {'step ms':>8} {'tok/s':>8} "
        + " ".join(f"{p[:11]:>11}" for p in STARTUP)
        + f" {'startup s':>9}"
    )
    print(head)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for layout in args.layouts:
                ranks, flags = LAYOUTS[layout]
                out = Path(tmp) / f"{model}-{layout}"
                records = launch(ranks, MODELS[model] + flags, args.steps, out)
                steady = records[1:] or records
                dt = statistics.median(r["train/dt"] for r in steady)
                tps = statistics.median(r["train/tps"] for r in steady)
                first = records[0]
                parts = " ".join(f"{first.get('startup/' + p, 0.0):11.2f}" for p in STARTUP)
                print(
                    f"{model:6} {layout:12} {dt * 1000:8.1f} {tps:8.0f} {parts} "
                    f"{first['train/startup_seconds']:9.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
