"""Per-step metrics: one JSON object a line in metrics-<rank>.jsonl, plus a line for people."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from contracts.env_names import ENV_ATTEMPT_DIR
from worker.args import TrainArgs


def metrics_dir(args: TrainArgs) -> Path:
    """The attempt's directory under the supervisor, else `--outdir`."""
    return Path(os.environ.get(ENV_ATTEMPT_DIR) or args.outdir)


class MetricsLog:
    """Appends one record per step; extra values (checkpoint and restart timings) are held until
    the next step's record, as docs/reports.md's metrics table says."""

    def __init__(self, path: Path | None):
        self._file = path.open("a", buffering=1) if path is not None else None
        self._pending: dict[str, float] = {}

    def add_to_next(self, name: str, value: float) -> None:
        self._pending[name] = self._pending.get(name, 0.0) + value

    def set_on_next(self, name: str, value: float) -> None:
        """A value that is not a sum (an interval now in force)."""
        self._pending[name] = value

    def record(self, step: int, loss: float, dt: float, tokens: int) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "step": step,
            "t": time.time(),
            "loss": loss if math.isfinite(loss) else str(loss),
            "train/dt": dt,
            "train/tps": tokens / dt if dt > 0 else 0.0,
            **self._pending,
        }
        self._pending = {}
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
        return entry

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def human_line(entry: dict[str, Any], train_iters: int) -> str:
    extras = " ".join(
        f"{k.split('/')[-1]}={v:.3f}s"
        for k, v in entry.items()
        if k.startswith("train/ckpt") or k == "train/restart_seconds"
    )
    return (
        f"step {entry['step']}/{train_iters} loss {entry['loss']:.4f} "
        f"dt {entry['train/dt'] * 1000:.1f}ms tps {entry['train/tps']:.0f} {extras}"
    ).rstrip()
