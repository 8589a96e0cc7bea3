"""Pure pieces of the worker: rank detection, layouts, data, checkpoint names and decisions,
test hooks, when to save."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from contracts import ckpt_files
from contracts.intervals import DURABLE
from worker.args import parse_args
from worker.build import intervals_of
from worker.data import SyntheticData, batch
from worker.dist import detect_rank
from worker.errors import UsageError
from worker.hooks import Hooks, from_env
from worker.layout import plan_layout
from worker.loop import save_due
from worker.presets import PRESETS, resolve_config


@pytest.mark.parametrize(
    "env,expect",
    [
        (
            {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            (3, 4, 1, 2, "hydra"),
        ),
        (
            {
                "PALS_RANKID": "5",
                "PMI_SIZE": "24",
                "PALS_LOCAL_RANKID": "5",
                "PALS_LOCAL_SIZE": "12",
            },
            (5, 24, 5, 12, "pals"),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            (1, 2, 1, 2, "openmpi"),
        ),
        (
            {
                "SLURM_PROCID": "7",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "3",
                "SLURM_NTASKS_PER_NODE": "4(x2)",
            },
            (7, 8, 3, 4, "slurm"),
        ),
        (  # srun's PMI-2 plugin sets PMI_RANK and PMI_SIZE but no local rank: Slurm's
            {
                "PMI_RANK": "5",
                "PMI_SIZE": "8",
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "1",
                "SLURM_NTASKS_PER_NODE": "4",
            },
            (5, 8, 1, 4, "hydra"),
        ),
        (
            {
                "RANK": "2",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "2",
                "PMI_RANK": "0",
            },
            (2, 4, 0, 2, "torchrun"),
        ),
        ({}, (0, 1, 0, 1, "single")),
    ],
)
def test_detect_rank(env, expect):
    info = detect_rank(env, host="h")
    assert (info.rank, info.world, info.local_rank, info.local_world, info.launcher) == expect


def test_layouts():
    assert plan_layout(4, 1, 1).dims() == [("dp_shard", 4)]
    assert plan_layout(4, 1, 2).dims() == [("dp_replicate", 2), ("dp_shard", 2)]
    tp = plan_layout(4, 2, 1)
    assert tp.dims() == [("dp_shard", 2), ("tp", 2)]
    assert [tp.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan_layout(1, 1, 1).dims() == [("dp_shard", 1)]
    with pytest.raises(UsageError, match="world size 6 is not divisible by --tp 4"):
        plan_layout(6, 4, 1)


def test_presets_match_ezpz_sizes():
    assert PRESETS["agpt-2b"].num_params() == pytest.approx(2.0e9, rel=0.15)
    assert PRESETS["agpt-20b"].num_params() == pytest.approx(20e9, rel=0.15)
    cfg = resolve_config("debug", dim=64, n_layers=None)
    assert cfg.dim == 64 and cfg.n_layers == 4
    assert cfg.fingerprint() != PRESETS["debug"].fingerprint()
    assert resolve_config("debug", seq_len=64).fingerprint() == PRESETS["debug"].fingerprint()


def test_batches_are_a_pure_function_of_seed_step_and_rank():
    data = SyntheticData(vocab_size=100, seq_len=16, seed=3)
    a_in, a_out = batch(data, step=5, dp_rank=1, batch_size=2)
    b_in, _ = batch(data, step=5, dp_rank=1, batch_size=2)
    assert a_in.equal(b_in)
    assert a_in[:, 1:].equal(a_out[:, :-1])
    assert not batch(data, 6, 1, 2)[0].equal(a_in)
    assert not batch(data, 5, 0, 2)[0].equal(a_in)
    # Two data-parallel ranks together see exactly what one process sees with both batches.
    whole, _ = batch(data, 5, 0, 4)
    parts = np.concatenate([batch(data, 5, r, 2)[0].numpy() for r in range(2)])
    assert np.array_equal(whole.numpy(), parts)


def _make(root, step, complete):
    d = ckpt_files.step_dir(root, step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * step)
    if complete:
        ckpt_files.mark_complete(d, {"files": ckpt_files.record_files(d)})
    return d


def test_resume_order_and_retention(tmp_path):
    for step, complete in [
        (10, True),
        (20, False),
        (30, True),
        (40, True),
        (50, True),
        (60, False),
    ]:
        _make(tmp_path, step, complete)
    found = ckpt_files.scan(tmp_path)
    assert [f.step for f in ckpt_files.resume_candidates(found)] == [50, 40, 30, 10]
    doomed = ckpt_files.retention_plan(found, keep=2)
    # Complete beyond the newest 2, incomplete older than the newest complete; 60 may be in flight.
    assert [f.step for f in doomed] == [10, 20, 30]
    ckpt_files.remove(doomed)
    assert [f.step for f in ckpt_files.scan(tmp_path)] == [40, 50, 60]
    assert [f.step for f in ckpt_files.retention_plan(ckpt_files.scan(tmp_path), keep=1)] == [40]
    # Never the newest complete, whatever keep says.
    assert 50 not in [f.step for f in ckpt_files.retention_plan(ckpt_files.scan(tmp_path), keep=0)]


def test_stale_marker_never_vouches_for_a_reused_directory(tmp_path):
    d = _make(tmp_path, 5, complete=True)
    ckpt_files.prepare_step_dir(d)
    assert not (d / ckpt_files.MARKER).exists() and list(d.iterdir()) == []
    assert ckpt_files.resume_candidates(ckpt_files.scan(tmp_path)) == []
    # the old contents were set aside in one rename, for deletion after the next marker
    (aside,) = tmp_path.glob(f"{ckpt_files.SET_ASIDE}*")
    assert [f.step for f in ckpt_files.scan(tmp_path)] == [5]
    ckpt_files.remove_set_aside(tmp_path)
    assert not aside.exists() and d.is_dir()


def test_verify_names_what_failed(tmp_path):
    d = _make(tmp_path, 8, complete=False)
    record = ckpt_files.record_files(d, {"__0_0.distcp": ckpt_files.file_crc(d / "__0_0.distcp")})
    assert ckpt_files.verify_problem(d, record) is None
    (d / "__0_0.distcp").write_bytes(b"y" * 8)  # same size, other bytes
    assert "fails its checksum" in ckpt_files.verify_problem(d, record)
    assert ckpt_files.verify_problem(d, record, check_crc=False) is None
    (d / "__0_0.distcp").write_bytes(b"y" * 3)
    assert "has 3 bytes, 8 recorded" in ckpt_files.verify_problem(d, record)
    (d / "__0_0.distcp").unlink()
    assert "missing" in ckpt_files.verify_problem(d, record)


def test_step_dir_names_parse_back():
    assert ckpt_files.parse_step(ckpt_files.step_dir(Path("/c"), 120).name) == 120
    assert ckpt_files.marker(Path("/c"), 7) == Path("/c/step-7/.complete")
    for other in ("step-", "step-1a", "step-3.tmp", ".set-aside-step-4-ab", "steps-5"):
        assert ckpt_files.parse_step(other) is None


def test_hooks_do_nothing_without_inject():
    hooks = from_env({}, rank=0, async_ckpt=False)
    assert type(hooks) is Hooks and hooks.write_delay_s == 0
    hooks.in_step(1)
    hooks.after_write(1)
    hooks.in_async_phase("stage", 1)
    assert type(from_env({"ES_INJECT": "rank=1"}, rank=1, async_ckpt=False)) is Hooks


def test_injected_failure_hits_only_the_chosen_rank_and_step():
    env = {"ES_INJECT": "rank=1,raise_at_step=3"}
    from_env(env, rank=0, async_ckpt=False).in_step(3)  # not this rank
    hooks = from_env(env, rank=1, async_ckpt=False)
    hooks.in_step(2)
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        hooks.in_step(3)
    delay = {"ES_INJECT": "ckpt_delay_s=0.5"}
    assert from_env(delay, rank=0, async_ckpt=True).write_delay_s == 0.5  # every rank


def test_a_bad_inject_is_a_usage_error():
    with pytest.raises(UsageError, match="ES_INJECT: unknown point 'nope'"):
        from_env({"ES_INJECT": "nope=1"}, rank=0, async_ckpt=False)
    kill = {"ES_INJECT": "kill_in_save_at_step=4,kill_async_phase=write"}
    with pytest.raises(UsageError, match="kill_async_phase needs --async-ckpt"):
        from_env(kill, rank=0, async_ckpt=False)
    assert from_env(kill, rank=0, async_ckpt=True).kill_async_phase == "write"


@pytest.mark.parametrize(
    "flags,step,stopping,due",
    [
        (["--save-interval", "5"], 10, False, True),
        (["--save-interval", "5"], 11, False, False),
        (["--save-interval", "0"], 11, True, True),  # a stop saves
        (["--save-interval", "0"], 20, False, True),  # the last step saves
        (["--save-interval", "0", "--no-save-on-exit"], 20, True, False),
        (["--save-interval", "0", "--no-save-on-exit", "--train-iters", "30"], 20, False, False),
    ],
)
def test_save_decision(flags, step, stopping, due):
    args = parse_args(["--train-iters", "20", "--ckpt-dir", "c", *flags])
    periodic = intervals_of(args, rank=0).due(DURABLE, step)
    assert save_due(args, periodic, step, stopping) is due
