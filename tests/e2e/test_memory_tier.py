"""The memory tier end to end: real mpiexec, real SIGKILLs, slots in a real tmpfs.

Every resume from memory must compute the uninterrupted run's losses bit for bit; any doubt
(a torn or missing slot on one rank, another world size) sends every rank to the durable tier.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from contracts import ckpt_files
from tests.support import (
    ITERS,
    TINY,
    assert_same_losses,
    inject_env,
    rank_env,
    read_metrics,
    run_worker,
)
from worker.ckpt import memory


def flags(tmp_path: Path, name: str, *more: str) -> list[str]:
    return [
        *TINY,
        *more,
        "--train-iters",
        str(ITERS),
        "--save-interval",
        "4",
        "--mem-ckpt-interval",
        "1",
        "--outdir",
        str(tmp_path / name),
        "--ckpt-dir",
        str(tmp_path / f"{name}-ckpt"),
    ]


def uninterrupted(reference, ranks: int, *more: str) -> dict[int, float]:
    """The uninterrupted run (no memory tier: the tier must not change what is computed)."""
    return reference(ranks, *TINY, *more, "--train-iters", str(ITERS))


@dataclass(frozen=True)
class SlotState:
    step: int | None
    gen: int
    torn: bool
    path: Path


def slot_state(directory: Path, rank: int, slot: int) -> SlotState:
    """What a slot holds, read as the agreement reads it (header generations, record)."""
    bin_path, json_path = memory.slot_paths(directory, rank, slot)
    before, after, _ = memory.read_header(bin_path)
    record = json.loads(json_path.read_text()) if json_path.exists() else {}
    torn = not before == after == record.get("gen")
    return SlotState(record.get("step"), before, torn, bin_path)


def the_job_dir(root: Path) -> Path:
    (found,) = list(root.glob("es-mem-*"))
    return found


@pytest.fixture(scope="module")
def died(tmp_path_factory):
    """`died(**points)`: a 2-rank run that failed at these failure points (contracts.inject),
    run once per module for every test that starts from it. Each call gives it back as it was
    left (its outdir, checkpoints and memory slots restored at the same paths, so the slots'
    run identity holds): (args, the memory tier's job dir, env, the run's root)."""
    mem = Path("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp") / f"es-test-died-{os.getpid()}"
    runs: dict[tuple, tuple] = {}

    def get(**points) -> tuple[list[str], Path, dict, Path]:
        key = tuple(sorted(points.items()))
        if key not in runs:
            root, kept = tmp_path_factory.mktemp("died"), tmp_path_factory.mktemp("died-kept")
            shutil.rmtree(mem, ignore_errors=True)
            mem.mkdir(mode=0o700)
            env = rank_env(ES_MEM_ROOT=str(mem))
            args = flags(root, "m")
            failed = run_worker(2, *args, env={**env, **inject_env(**points)})
            assert failed.returncode != 0
            directory = the_job_dir(mem)
            shutil.copytree(root, kept / "job", symlinks=True)
            shutil.copytree(mem, kept / "mem", symlinks=True)
            runs[key] = (args, directory, env, root, kept)
        args, directory, env, root, kept = runs[key]
        for live, saved in ((root, kept / "job"), (mem, kept / "mem")):
            shutil.rmtree(live, ignore_errors=True)
            shutil.copytree(saved, live, symlinks=True)
        return args, directory, env, root

    yield get
    shutil.rmtree(mem, ignore_errors=True)


@pytest.fixture
def failed_at_8(died):
    """A run whose rank 1 dies (raising) as step 8 begins: every rank holds step 6 complete
    (its copy was waited for before step 7's update) and step 7 complete or torn (its copy
    may have been cut short)."""
    return lambda: died(rank=1, raise_at_step=8)


# Rank 1 killed inside its copy of step 6: its slots hold 5 whole and 6 torn.
KILL_IN_COPY = {"rank": 1, "kill_in_mem_copy_at_step": 6}


@pytest.mark.slow
def test_a_kill_in_the_middle_of_a_copy_resumes_from_the_copy_before(reference, died):
    args, directory, env, job = died(**KILL_IN_COPY)
    slots = [slot_state(directory, 1, s) for s in range(2)]
    assert any(s.torn for s in slots), slots
    assert any(s.step == 5 and not s.torn for s in slots), slots
    again = run_worker(2, *args, env=env)
    assert again.returncode == 0, again.stderr
    assert "memory tier: every rank holds step 5" in again.stdout
    assert "RESUMED from step=5 (memory" in again.stdout
    assert_same_losses(uninterrupted(reference, 2), job / "m/metrics-0.jsonl")


@pytest.mark.slow
def test_a_slot_torn_by_hand_is_never_resumed(reference, died):
    """Rank 1 died inside its copy of step 6 (slots: 5 whole, 6 torn); rank 0 holds 5 whole
    (the run the kill-in-a-copy test resumes). Rank 0's slot of step 5 then has its closing
    generation rewritten: no step is held whole by both, so every rank resumes from the
    durable tier (were the torn slot taken, it would be memory step 5)."""
    args, directory, env, job = died(**KILL_IN_COPY)
    assert {(s.step, s.torn) for s in (slot_state(directory, 1, i) for i in range(2))} >= {
        (5, False)
    }
    (five,) = [s for s in (slot_state(directory, 0, i) for i in range(2)) if s.step == 5]
    assert not five.torn
    with five.path.open("r+b") as f:  # its closing generation, as if the copy was cut short
        f.seek(16)
        f.write(struct.pack("<Q", five.gen + 99))
    again = run_worker(2, *args, env=env)
    assert again.returncode == 0, again.stderr
    assert "memory tier: no step held complete by every rank" in again.stdout
    assert f"RESUMED from step=4 ({ckpt_files.step_dir(job / 'm-ckpt', 4)})" in again.stdout
    assert_same_losses(uninterrupted(reference, 2), job / "m/metrics-0.jsonl")


@pytest.mark.slow
def test_a_missing_slot_on_one_rank_sends_every_rank_to_the_durable_tier(reference, failed_at_8):
    args, directory, env, job = failed_at_8()
    shutil.rmtree(directory / "rank-1")
    again = run_worker(2, *args, env=env)
    assert again.returncode == 0, again.stderr
    assert "memory tier: no step held complete by every rank (none on rank(s) 1" in again.stdout
    assert f"RESUMED from step=4 ({ckpt_files.step_dir(job / 'm-ckpt', 4)})" in again.stdout
    assert_same_losses(uninterrupted(reference, 2), job / "m/metrics-0.jsonl")


@pytest.mark.slow
def test_another_world_size_resumes_from_the_durable_tier_resharded(failed_at_8):
    args, _, env, job = failed_at_8()
    again = run_worker(4, *args, env=env)
    assert again.returncode == 0, again.stderr
    assert "(memory" not in again.stdout
    assert f"RESUMED from step=4 ({ckpt_files.step_dir(job / 'm-ckpt', 4)})" in again.stdout


@pytest.mark.slow
def test_no_resume_ignores_and_forgets_the_memory_tier(failed_at_8):
    args, directory, env, _ = failed_at_8()
    crash = inject_env(rank=1, raise_at_step=3)
    fresh = run_worker(2, *args, "--no-resume", env={**env, **crash})
    assert fresh.returncode != 0
    assert "RESUMED" not in fresh.stdout
    held = {json.loads(p.read_text())["step"] for p in directory.glob("rank-*/slot-*.json")}
    assert held and held <= {1, 2}, held  # the fresh run's own copies; none of the old timeline's


@pytest.mark.slow
def test_an_async_save_writes_the_memory_copy_out_and_resumes_bit_exact(
    tmp_path, reference, mem_root
):
    """An async durable save on a step the memory tier copies anyway writes that copy out (no
    second staging copy); the durable checkpoint so written resumes bit for bit."""
    env = rank_env(ES_MEM_ROOT=str(mem_root))
    args = [*flags(tmp_path, "m"), "--async-ckpt"]
    died = run_worker(2, *args, env={**env, **inject_env(rank=1, raise_at_step=10)})
    assert died.returncode != 0
    records = read_metrics(tmp_path / "m/metrics-0.jsonl")
    staged = [
        r["train/ckpt_stage_copy_seconds"] for r in records if "train/ckpt_stage_copy_seconds" in r
    ]
    assert staged and all(s == 0.0 for s in staged), staged  # borrowed: nothing copied again
    shutil.rmtree(the_job_dir(mem_root))  # as if the node were new: the durable tier only
    again = run_worker(2, *args, env=env)
    assert again.returncode == 0, again.stderr
    resumed = re.search(r"RESUMED from step=(\d+) \((\S+)\)", again.stdout)
    assert resumed and int(resumed[1]) in (4, 8), again.stdout  # written from a borrowed copy
    assert resumed[2] == str(ckpt_files.step_dir(tmp_path / "m-ckpt", int(resumed[1])))
    assert_same_losses(uninterrupted(reference, 2), tmp_path / "m/metrics-0.jsonl")
