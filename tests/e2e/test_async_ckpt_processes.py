"""Async checkpoints end to end: real mpiexec, real SIGKILL in each phase of a save, DCP on disk.
The pure parts (readiness, which files a rank copies, fan-out) are in unit/test_async_ckpt.py."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from contracts import ckpt_files
from tests.support import (
    ITERS,
    TINY,
    assert_same_losses,
    inject_env,
    losses,
    rank_env,
    read_metrics,
    run_worker,
    start_worker,
    tiered,
)

INTERVAL, KILL_STEP = 4, 8
COMMON = [*TINY, "--train-iters", str(ITERS), "--save-interval", str(INTERVAL)]


@pytest.fixture
def baseline(reference) -> dict[int, float]:
    """The uninterrupted run's loss at every step (no checkpoints at all)."""
    return reference(2, *TINY, "--train-iters", str(ITERS))


def async_args(tmp_path: Path) -> list[str]:
    return [
        *COMMON,
        "--async-ckpt",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-stage-dir",
        str(tmp_path / "stage"),
        "--outdir",
        str(tmp_path / "m"),
    ]


# phase -> (rank killed, newest marked step afterwards)
KILLS = {
    "stage": (1, INTERVAL),
    "write": (1, INTERVAL),
    "fanout": (1, INTERVAL),
    "marker": (1, INTERVAL),
    "after-marker": (0, KILL_STEP),  # rank 0 writes the marker
}


@pytest.mark.parametrize("phase", tiered(KILLS, "after-marker"))
def test_kill_in_each_phase_resumes_bit_exact(tmp_path, baseline, phase):
    rank, marked = KILLS[phase]
    args = async_args(tmp_path)
    ckpt, stage = tmp_path / "ckpt", tmp_path / "stage"
    kill = inject_env(rank=rank, kill_in_save_at_step=KILL_STEP, kill_async_phase=phase)
    died = run_worker(2, *args, env=rank_env(**kill))
    assert died.returncode != 0, died.stdout
    found = {f.step: f.complete for f in ckpt_files.scan(ckpt)}
    assert max(s for s, complete in found.items() if complete) == marked, found
    if phase == "write":  # the dead attempt's local copy is still there ...
        assert list(ckpt_files.step_dir(stage, KILL_STEP).glob("__1_*.distcp"))
    if phase == "fanout":  # ... or its half-copied file, under its temporary name only
        durable = ckpt_files.step_dir(ckpt, KILL_STEP)
        assert list(durable.glob(".tmp-__1_*")) and not list(durable.glob("__1_*"))

    again = run_worker(2, *args)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"RESUMED from step={marked}" in again.stdout
    assert_same_losses(baseline, tmp_path / "m/metrics-0.jsonl")
    # ... and gone after the next start; the finished run leaves no stage copies behind.
    assert list(stage.iterdir()) == []
    assert all(complete for complete in {f.complete for f in ckpt_files.scan(ckpt)})


@pytest.mark.slow
def test_slow_write_marks_before_next_save_and_stages_one_step(tmp_path):
    """The background write starts well after the stage while training runs on and changes
    every parameter; the marker still lands before the next save (not at it: the study's second
    dead end), and the checkpoint holds exactly the saved step's state."""
    iters, interval, delay = 60, 30, 0.2  # 30 steps outlast 0.2 s
    args = [
        *TINY,
        "--train-iters",
        str(iters),
        "--save-interval",
        str(interval),
        "--async-ckpt",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-stage-dir",
        str(tmp_path / "stage"),
        "--log-every",
        "30",
    ]
    slow = rank_env(**inject_env(ckpt_delay_s=delay))
    first = run_worker(2, *args, "--outdir", str(tmp_path / "a"), env=slow)
    assert first.returncode == 0, first.stdout + first.stderr
    marked = re.search(rf"checkpoint step={interval} complete at step=(\d+)", first.stdout)
    assert marked, first.stdout
    assert interval < int(marked.group(1)) < iters
    records = read_metrics(tmp_path / "a/metrics-0.jsonl")
    took = [r["train/ckpt_marker_seconds"] for r in records if "train/ckpt_marker_seconds" in r]
    assert took[0] >= delay
    assert "train/ckpt_stage_seconds" in records[interval]  # the stall, on step interval + 1

    ckpt_files.remove([f for f in ckpt_files.scan(tmp_path / "ckpt") if f.step == iters])
    second = run_worker(2, *args, "--outdir", str(tmp_path / "b"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"RESUMED from step={interval}" in second.stdout
    want = losses(tmp_path / "a/metrics-0.jsonl")
    got = losses(tmp_path / "b/metrics-0.jsonl")
    assert sorted(got) == list(range(interval + 1, iters + 1))
    assert all(got[s] == want[s] for s in got), [(s, got[s], want[s]) for s in got]


@pytest.mark.slow
def test_sigterm_drains_and_marks_the_stop_step(tmp_path):
    """A graceful stop saves at the stop step and marks it before exit 0, with a save from an
    earlier step possibly still in flight."""
    out = tmp_path / "m"
    args = [
        *TINY,
        "--train-iters",
        "400",
        "--save-interval",
        "3",
        "--async-ckpt",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--ckpt-stage-dir",
        str(tmp_path / "stage"),
        "--outdir",
        str(out),
    ]
    proc = start_worker(2, *args)
    deadline = time.monotonic() + 120
    while not [r for r in read_metrics(out / "metrics-0.jsonl") if r["step"] >= 4]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    stop = read_metrics(out / "metrics-0.jsonl")[-1]["step"]
    assert f"checkpoint step={stop} complete" in output
    assert (ckpt_files.step_dir(tmp_path / "ckpt", stop) / ckpt_files.MARKER).exists()
    assert list((tmp_path / "stage").iterdir()) == []
