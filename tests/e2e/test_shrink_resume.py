"""The worker's side of a shrink, end to end: real mpiexec, gloo, DCP on disk.

A checkpoint of a run on W ranks resumes on W' < W ranks with the flags `plan_shrink` gives:
resharded from the durable tier, never from the memory tier (another world), the steps
continuing where the checkpoint left off. Where the global batch is kept, the resumed losses are
the uninterrupted run's to float tolerance (the reduction order differs, so not bit for bit).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from contracts import ckpt_files
from supervisor.settings.config import flags_from_table
from tests.support import TINY_SIZES, inject_env, losses, rank_env, read_metrics, run_worker
from worker.ckpt import memory
from worker.spec import plan_shrink

pytestmark = pytest.mark.slow

TINY = {**TINY_SIZES, "train_iters": 8, "save_interval": 4}
SEQ = TINY["seq_len"]


def run(ranks: int, table: dict, out: Path, *extra: str, env: dict | None = None):
    return run_worker(ranks, *flags_from_table(table), "--outdir", str(out), *extra, env=env)


def shrink_and_resume(tmp_path: Path, table: dict, world: int, new_world: int):
    """The first run to step 8 (checkpoints at 4 and 8), step 8's removed (a copy of what is
    left kept as ckpt-4, for another resume), then the planned smaller world resumes from step
    4 to step 8."""
    ckpt = tmp_path / "ckpt"
    table = {**table, "ckpt_dir": str(ckpt)}
    first = run(world, table, tmp_path / "a")
    assert first.returncode == 0, first.stdout + first.stderr
    ckpt_files.remove([f for f in ckpt_files.scan(ckpt) if f.step == 8])
    shutil.copytree(ckpt, tmp_path / "ckpt-4")
    plan = plan_shrink(flags_from_table(table), world, new_world)
    assert plan.problem is None, plan.problem
    second = run(new_world, {**table, **plan.flags}, tmp_path / "b")
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"RESUMED from step=4 ({ckpt_files.step_dir(ckpt, 4)})" in second.stdout
    assert f"on {new_world} ranks [{plan.mesh[1]}]" in second.stdout
    got = read_metrics(tmp_path / "b/metrics-0.jsonl")
    assert [r["step"] for r in got] == [5, 6, 7, 8]  # none repeated, none skipped
    tokens = ckpt_files.read_meta(ckpt_files.step_dir(ckpt, 8))["tokens_seen"]
    assert tokens == 4 * plan.tokens_per_step[0] + 4 * plan.tokens_per_step[1]
    return plan, losses(tmp_path / "a/metrics-0.jsonl"), got


def assert_close(want: dict[int, float], got: list[dict]) -> None:
    for r in got:
        if r["step"] in want:
            assert math.isclose(r["loss"], want[r["step"]], rel_tol=1e-5), (r, want[r["step"]])


def test_fsdp_3_to_2_keeps_the_global_batch_and_never_takes_the_memory_tier(tmp_path, mem_root):
    """3 ranks x 2 sequences die at step 8 with every rank's memory copy of step 7 newer than the
    durable step 4; 2 ranks x 3 sequences (the plan) resume from the durable step 4, resharded:
    a memory copy of another world is never loaded."""
    env = rank_env(ES_MEM_ROOT=str(mem_root))
    ckpt = tmp_path / "ckpt"
    table = {**TINY, "batch_size": 2, "ckpt_dir": str(ckpt), "mem_ckpt_interval": 1}
    crash = {**env, **inject_env(rank=1, raise_at_step=8)}
    died = run(3, table, tmp_path / "a", env=crash)
    assert died.returncode != 0
    (job_dir,) = mem_root.glob("es-mem-*")
    held = [held_steps(job_dir, rank) for rank in range(3)]
    # Every rank holds a whole copy ahead of the durable step 4 (step 7's may be torn: its copy
    # runs beside step 8, which rank 1 never finished).
    assert all(steps and steps[0] >= 6 for steps in held), held
    assert [f.step for f in ckpt_files.resume_candidates(ckpt_files.scan(ckpt))] == [4]

    plan = plan_shrink(flags_from_table(table), 3, 2)
    assert plan.flags == {"batch_size": 3} and plan.batch_kept
    again = run(2, {**table, **plan.flags}, tmp_path / "b", env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "(memory" not in again.stdout
    assert f"RESUMED from step=4 ({ckpt_files.step_dir(ckpt, 4)})" in again.stdout
    got = read_metrics(tmp_path / "b/metrics-0.jsonl")
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    # The 3-rank run, uninterrupted up to step 7: rank 0's record of step 7 can be lost when the
    # launcher ends it for rank 1's failure, so compare the steps it kept (at least 1-6).
    want = losses(tmp_path / "a/metrics-0.jsonl")
    assert set(range(1, 7)) <= set(want) <= set(range(1, 8)), sorted(want)
    assert_close(want, got)
    assert ckpt_files.read_meta(ckpt_files.step_dir(ckpt, 8))["tokens_seen"] == 8 * 6 * SEQ


def held_steps(job_dir: Path, rank: int) -> list[int]:
    """The steps of rank `rank`'s whole slots, each checked as its own run would check it."""
    record = json.loads(memory.slot_paths(job_dir, rank, 0)[1].read_text())
    keys = ("job", "rank", "world", "mesh", "model_fingerprint", "host")
    held, _ = memory.find(job_dir, memory.Expect(**{k: record[k] for k in keys}))
    return [h.step for h in held]


@pytest.mark.parametrize(
    "more,world,new_world,batch_size",
    [({"tp": 2}, 4, 2, 4), ({"replicate": 2}, 4, 2, 4)],
    ids=["fsdp_tp-4-to-tp-2", "hsdp-4-to-2-shards-of-one"],
)
def test_the_planned_smaller_world_follows_the_uninterrupted_run(
    tmp_path, more, world, new_world, batch_size
):
    plan, want, got = shrink_and_resume(tmp_path, {**TINY, **more}, world, new_world)
    assert plan.flags == {"batch_size": batch_size} and plan.batch_kept
    assert_close(want, got)
    if "tp" in more:
        # The same FSDP+TP checkpoint (4 ranks x 2 sequences) on plain FSDP, 2 ranks x 2: the
        # global batch kept, tensor parallelism dropped; reduction order differs more.
        again = run(2, {**TINY, "ckpt_dir": str(tmp_path / "ckpt-4")}, tmp_path / "c")
        assert again.returncode == 0, again.stdout + again.stderr
        assert (
            f"RESUMED from step=4 ({ckpt_files.step_dir(tmp_path / 'ckpt-4', 4)})" in again.stdout
        )
        fsdp = read_metrics(tmp_path / "c/metrics-0.jsonl")
        assert [r["step"] for r in fsdp] == [5, 6, 7, 8]
        for r in fsdp:
            assert math.isclose(r["loss"], want[r["step"]], rel_tol=1e-4), (r, want[r["step"]])


def test_a_batch_that_does_not_divide_still_trains_on(tmp_path):
    """3 ranks x 1 sequence on 2 ranks: the global batch becomes 2 sequences, as the plan says;
    the steps go on from the checkpoint and the loss stays finite."""
    plan, want, got = shrink_and_resume(tmp_path, {**TINY, "batch_size": 1}, 3, 2)
    assert plan.flags == {} and not plan.batch_kept
    assert plan.global_batch == (3, 2)
    assert all(math.isfinite(r["loss"]) for r in got)
    assert abs(got[0]["loss"] - want[5]) < 0.5 * want[5]  # the same model, a smaller batch
