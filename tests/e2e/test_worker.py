"""The training worker under real mpiexec on CPU/gloo: layouts, determinism, failures, bad input."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from tests.support import (
    ITERS,
    REPO,
    TINY,
    inject_env,
    losses,
    mpiexec,
    rank_env,
    read_metrics,
    run_worker,
)


@pytest.mark.slow
def test_fsdp_tp_matches_one_process(tmp_path, reference):
    """2-D FSDP+TP computes what one process computes on the same global batch: the 4-rank run
    is the shared uninterrupted FSDP+TP reference (4 ranks x 2 sequences), its first steps."""
    tp = reference(4, *TINY, "--tp", "2", "--train-iters", str(ITERS))
    ref = run_worker(1, *TINY, "--train-iters", str(ITERS), "--batch-size", "4",
                     "--outdir", str(tmp_path / "one"))  # fmt: skip
    assert ref.returncode == 0, ref.stderr
    one = losses(tmp_path / "one/metrics-0.jsonl")
    assert one.keys() == tp.keys() == set(range(1, ITERS + 1))
    for step in range(1, 5):
        assert math.isclose(one[step], tp[step], rel_tol=1e-5), (step, one[step], tp[step])


@pytest.mark.slow
def test_same_seed_is_bit_identical(tmp_path, reference):
    want = reference(2, *TINY, "--train-iters", str(ITERS))  # another run of the same seed
    again = run_worker(2, *TINY, "--train-iters", str(ITERS), "--outdir", str(tmp_path / "a"))
    assert again.returncode == 0, again.stderr
    assert losses(tmp_path / "a" / "metrics-0.jsonl") == want
    other = run_worker(
        2, *TINY, "--train-iters", "2", "--seed", "8", "--outdir", str(tmp_path / "c")
    )
    assert other.returncode == 0
    assert losses(tmp_path / "c/metrics-0.jsonl")[1] != want[1]


@pytest.mark.slow
def test_raising_rank_brings_job_down(tmp_path):
    started = time.monotonic()
    out = run_worker(
        2,
        *TINY,
        "--train-iters",
        "1000",
        "--outdir",
        str(tmp_path),
        timeout=90,
        env=rank_env(**inject_env(rank=1, raise_at_step=3)),
    )
    elapsed = time.monotonic() - started
    assert out.returncode != 0
    assert "injected failure at step 3" in out.stdout + out.stderr
    # Start-up is most of it; without the abort path rank 0 would sit in a collective until
    # the process-group timeout (600 s).
    assert elapsed < 60
    assert max(r["step"] for r in read_metrics(tmp_path / "metrics-0.jsonl")) < 5


BAD_INPUT = [
    (["--model", "nope"], "unknown model preset 'nope'"),
    (["--tp", "3"], "world size 2 is not divisible by --tp 3"),
    (["--tp", "2", "--n-kv-heads", "1"], "--tp 2 does not divide n_kv_heads=1"),
    (["--data-path", "/nonexistent/tokens.bin"], "token file /nonexistent/tokens.bin"),
    (["--outdir", "/proc/forbidden"], "output directory /proc/forbidden is not writable"),
    (["--ckpt-dir", "/proc/forbidden"], "--ckpt-dir directory /proc/forbidden"),
    (["--train-iters", "0"], "--train-iters must be at least 1"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
]


def assert_one_clear_line(out, message: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert len([line for line in out.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.parametrize("flags,message", BAD_INPUT)
def test_bad_input_is_one_clear_line(tmp_path, flags, message):
    """Rank 0 of a 2-rank job as the launcher's environment describes it: the flags are refused
    before torch is imported or a peer is waited for, so one process tells it all."""
    env = rank_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    out = subprocess.run(
        [sys.executable, "-m", "worker.train", *TINY, "--outdir", str(tmp_path), *flags],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_one_clear_line(out, message)


BAD_INJECT = [
    ("bogus=1", "ES_INJECT: unknown point 'bogus'"),
    ("raise_at_step=x", "ES_INJECT: raise_at_step='x' is not a step"),
    ("kill_in_save_at_step=3,kill_async_phase=write", "kill_async_phase needs --async-ckpt"),
]


@pytest.mark.parametrize("points,message", BAD_INJECT)
def test_bad_inject_is_one_clear_line(tmp_path, points, message):
    """A test's failure points are input too: a bad one is refused like a bad flag."""
    env = rank_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", ES_INJECT=points)
    out = subprocess.run(
        [sys.executable, "-m", "worker.train", *TINY, "--outdir", str(tmp_path)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert_one_clear_line(out, message)


def test_bad_input_under_mpiexec_is_said_once_for_the_job(tmp_path):
    out = run_worker(2, *TINY, "--outdir", str(tmp_path), "--tp", "3", timeout=60)
    assert_one_clear_line(out, "world size 2 is not divisible by --tp 3")


@pytest.mark.parametrize("refusing", [0, 1])
def test_one_rank_refusing_its_directory_under_mpiexec_ends_the_job(tmp_path, refusing):
    """One rank's output directory cannot be written, the other's can (per-rank flags, as a
    node-local path on one bad host would): the refusing rank ends the whole job, which would
    otherwise wait in MPI_Init for it forever, with its line and exit 2."""
    rank_flags = [["--outdir", str(tmp_path / f"out-{r}")] for r in (0, 1)]
    rank_flags[refusing] = ["--outdir", "/proc/forbidden"]
    cmd = [mpiexec()]
    for flags in rank_flags:
        cmd += ["-n", "1", sys.executable, "-m", "worker.train", *TINY, *flags, ":"]
    out = subprocess.run(
        cmd[:-1], env=rank_env(), cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "output directory /proc/forbidden is not writable" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.slow
def test_token_file_dataset(tmp_path):
    import numpy as np

    tokens = (np.arange(50_000) * 7 % 128).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    out = run_worker(
        2, *TINY, "--train-iters", "20", "--data-path", str(path), "--outdir", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    records = read_metrics(tmp_path / "metrics-0.jsonl")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
