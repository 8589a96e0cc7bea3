"""Fixtures shared by unit/ and e2e/ (plain helpers are in support.py)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from tests.support import (
    losses,
    read_metrics,
    rec,
    run_worker,
    synthetic_events,
    synthetic_metrics,
    write_run,
)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", synthetic_events(), synthetic_metrics())


@pytest.fixture
def baseline_dir(tmp_path: Path) -> Path:
    events = [
        {"event": "start", "ts": 2000.0, "mono": 500.0},
        {"event": "launch", "ts": 2000.0, "mono": 500.0, "attempt": 0},
        {"event": "first_step", "ts": 2009.0, "mono": 509.0, "attempt": 0, "step": 1},
        {"event": "done", "ts": 2059.0, "mono": 559.0, "attempt": 0, "step": 50},
        {"event": "supervisor_exit", "ts": 2060.0, "mono": 560.0, "code": 0, "code_name": "DONE"},
    ]
    metrics = {0: [{**rec(k, 2008.0 + k)} for k in range(1, 51)]}
    return write_run(tmp_path / "base", events, metrics, "[worker]\nsave_interval = 0\n")


@pytest.fixture
def mem_root() -> Path:
    """A fresh memory-tier root (ES_MEM_ROOT) in /dev/shm, removed after the test."""
    root = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp") / f"es-test-{uuid.uuid4().hex}"
    root.mkdir(mode=0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A gloo process group of this one process, for code that calls collectives (torch is
    imported here, not at the top: most tests never need it)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def assert_trained(records: list[dict]) -> None:
    """A run that trained: every step once, in order, with its metrics, and the loss falling."""
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    for r in records:
        assert {"step", "t", "loss", "train/dt", "train/tps"} <= r.keys()
    if len(records) >= 20:
        first = sum(r["loss"] for r in records[:3]) / 3
        last = sum(r["loss"] for r in records[-3:]) / 3
        assert last < first - 0.3, (first, last)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted run's loss at every step, `reference(ranks, *flags)`: run once per test
    run for each (ranks, flags) and shared by every test that compares a resumed run with it.
    The flags are those that decide what is computed (model, layout, batch, iterations, seed):
    checkpoints, the memory tier and async saves must not change a loss, so none are given.
    Each reference is checked to have trained (every step, its metrics, a falling loss), so
    every layout a test compares is also shown to learn."""
    done: dict[tuple, dict[int, float]] = {}

    def losses_of(ranks: int, *flags: str) -> dict[int, float]:
        key = (ranks, flags)
        if key not in done:
            out = tmp_path_factory.mktemp("reference")
            run = run_worker(ranks, *flags, "--outdir", str(out))
            assert run.returncode == 0, run.stdout + run.stderr
            assert_trained(read_metrics(out / "metrics-0.jsonl"))
            done[key] = losses(out / "metrics-0.jsonl")
        return done[key]

    return losses_of
