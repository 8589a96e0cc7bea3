"""Sharded checkpoints and resume, end to end: real mpiexec, real SIGKILL, real DCP on disk."""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import re
import shutil
import signal
import stat
from pathlib import Path

import pytest

from contracts import ckpt_files
from tests.support import (
    ITERS,
    LAYOUTS,
    TINY,
    assert_same_losses,
    inject_env,
    kill_every_rank,
    rank_env,
    read_metrics,
    run_worker,
    start_worker,
    tiered,
    wait_for_step,
)


@pytest.mark.parametrize("layout", tiered(LAYOUTS, "fsdp2"))
def test_killed_runs_resume_bit_exact_from_memory_and_from_disk(
    tmp_path, reference, mem_root, layout
):
    """The study's kill (SIGKILL to every rank at once) twice in one run with the memory tier
    on: the node's memory gone after the first, as if it were a new node, so resumed from the
    durable checkpoint; then resumed from memory (at most the step in flight lost), the copies
    made by a run that itself resumed. Every loss of every attempt, recomputed steps included,
    equals the uninterrupted run's. The 4-rank layouts are killed once, resumed from the
    durable tier: their resume from memory is test_standby's warm relaunch of them."""
    ranks, flags = LAYOUTS[layout]
    env = rank_env(ES_MEM_ROOT=str(mem_root))
    out, ckpt = tmp_path / "killed", tmp_path / "killed-ckpt"
    args = [*TINY, *flags, "--train-iters", str(ITERS), "--save-interval", "5",
            "--mem-ckpt-interval", "1", "--outdir", str(out), "--ckpt-dir", str(ckpt)]  # fmt: skip
    outputs, killed_at, last_recorded = [], [], []
    for target in (9, 17) if ranks == 2 else (9,):
        proc = start_worker(ranks, *args, env=env)
        killed_at.append(wait_for_step(out / "metrics-0.jsonl", target, proc))
        kill_every_rank(proc)
        # The ranks may have stepped (and saved) on while the kill was under way.
        last_recorded.append(read_metrics(out / "metrics-0.jsonl")[-1]["step"])
        assert proc.returncode != 0
        outputs.append(proc.stdout.read())
        (directory,) = mem_root.glob("es-mem-*")
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        for path in directory.glob("rank-*/slot-*"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        if target == 9:
            shutil.rmtree(directory)  # a new node: only the durable tier is left
    final = run_worker(ranks, *args, env=env)
    assert final.returncode == 0, final.stderr
    outputs.append(final.stdout)

    resumes = [re.search(r"RESUMED from step=(\d+) \(([^,)]+)", o) for o in outputs[1:]]
    assert all(resumes), outputs
    steps, sources = [int(m[1]) for m in resumes], [m[2] for m in resumes]
    assert sources[0] == str(ckpt_files.step_dir(ckpt, steps[0])), outputs[1]
    assert steps[0] % 5 == 0 and 0 < steps[0] <= last_recorded[0], (steps, last_recorded)
    if len(steps) > 1:
        assert sources[1] == "memory", outputs
        # The copy of step k is made before step k+1's update and sealed (checksummed, on the
        # copy thread) before the copy of k+1 starts: at most the step in flight and one copy
        # are lost.
        assert steps[1] >= killed_at[1] - 2 and steps[1] > steps[0], (steps, killed_at)
    restarts = [r for r in read_metrics(out / "metrics-0.jsonl") if "train/restart_seconds" in r]
    assert [r["step"] - 1 for r in restarts] == steps
    assert_same_losses(reference(ranks, *TINY, *flags, "--train-iters", str(ITERS)),
                       out / "metrics-0.jsonl")  # fmt: skip
    assert not list(mem_root.glob("es-mem-*")), "a run that ends well removes its slots"


@pytest.mark.slow
def test_kill_during_save_falls_back_to_previous(tmp_path, reference):
    common = [
        *TINY,
        "--train-iters",
        str(ITERS),
        "--save-interval",
        "4",
        "--outdir",
        str(tmp_path / "m"),
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
    ]
    kill = inject_env(rank=1, kill_in_save_at_step=8)
    died = run_worker(2, *common, env=rank_env(**kill))
    assert died.returncode != 0
    partial = ckpt_files.step_dir(tmp_path / "ckpt", 8)
    assert any(partial.glob("*.distcp")) and not (partial / ckpt_files.MARKER).exists()
    again = run_worker(2, *common)
    assert again.returncode == 0, again.stderr
    assert "RESUMED from step=4" in again.stdout
    assert_same_losses(reference(2, *TINY, "--train-iters", str(ITERS)),
                       tmp_path / "m/metrics-0.jsonl")  # fmt: skip


class _RunsCode:
    """A pickle that would run a command when unpickled (what a crafted checkpoint holds)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def spoil(step_dir: Path, how: str, marker: Path) -> tuple[Path, str]:
    """Damage a checkpoint (a shard truncated, a byte flipped) or craft it to run a command on
    load (DCP's .metadata or the RNG record replaced by a pickle, padded to the recorded size so
    only reading it can tell); the file spoilt and the start of what resume must say of it."""
    if how in ("truncate", "flip"):
        path = sorted(step_dir.glob("__1_*.distcp"))[0]
        data = bytearray(path.read_bytes())
        if how == "truncate":
            path.write_bytes(data[: len(data) // 2])
        else:
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        return path, str(path)
    if how == "dcp_metadata":
        path = step_dir / ".metadata"
        evil = pickle.dumps(_RunsCode(marker))
        size = path.stat().st_size
        assert len(evil) < size
        path.write_bytes(evil + b"\0" * (size - len(evil)))
    else:
        path = step_dir / ckpt_files.META
        meta = json.loads(path.read_text())
        meta["rng"][1] = base64.b64encode(pickle.dumps(_RunsCode(marker))).decode()
        path.write_text(json.dumps(meta))
    return path, "refused, it is not a checkpoint's content"


@pytest.mark.slow
def test_damaged_and_crafted_newest_checkpoints_are_skipped_and_never_run(tmp_path):
    """The two newest checkpoints spoilt, twice: a shard truncated and a byte flipped (found by
    --ckpt-verify crc); then DCP's metadata and the RNG record crafted to run a command. Each is
    refused with the file named, the run resumes from the newest one left, and no command from
    a checkpoint ever runs."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    common = [*TINY, "--save-interval", "3", "--ckpt-dir", str(ckpt), "--outdir", str(tmp_path)]
    first = run_worker(2, *common, "--ckpt-verify", "crc", "--train-iters", "12")
    assert first.returncode == 0, first.stderr
    step = 12
    # crc (recorded by the run that saved it) for a flipped byte; the crafted files keep their
    # size, so only reading them tells
    for verify, hows in (("crc", ("truncate", "flip")), ("size", ("dcp_metadata", "rng"))):
        spoilt = [(step - 3 * i, *spoil(ckpt_files.step_dir(ckpt, step - 3 * i), how, marker))
                  for i, how in enumerate(hows)]  # fmt: skip
        again = run_worker(2, *common, "--ckpt-verify", verify, "--train-iters", str(step + 3))
        assert again.returncode == 0, again.stderr
        for at, path, said in spoilt:
            assert f"skipping checkpoint step-{at}: {said}" in again.stdout, (at, again.stdout)
            assert str(path) in again.stdout
        assert f"RESUMED from step={step - 6}" in again.stdout
        step += 3
    assert not marker.exists()


@pytest.mark.slow
def test_sigterm_saves_at_stop_step_and_loses_nothing(tmp_path):
    out, ckpt = tmp_path / "m", tmp_path / "ckpt"
    args = [
        *TINY,
        "--train-iters",
        "400",
        "--save-interval",
        "1000",
        "--outdir",
        str(out),
        "--ckpt-dir",
        str(ckpt),
    ]
    proc = start_worker(2, *args)
    wait_for_step(out / "metrics-0.jsonl", 5, proc)
    proc.send_signal(signal.SIGTERM)  # mpiexec forwards it to every rank
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    stop_step = read_metrics(out / "metrics-0.jsonl")[-1]["step"]
    assert f"stop requested: exiting after step {stop_step}" in output
    assert (ckpt_files.step_dir(ckpt, stop_step) / ckpt_files.MARKER).exists()
    resumed = run_worker(
        2,
        *args[:-4],
        "--outdir",
        str(out),
        "--ckpt-dir",
        str(ckpt),
        "--train-iters",
        str(stop_step + 3),
    )
    assert f"RESUMED from step={stop_step}" in resumed.stdout
    steps = [r["step"] for r in read_metrics(out / "metrics-0.jsonl")]
    assert steps == list(range(1, stop_step + 4))  # no step lost, none repeated


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Path:
    """One run's checkpoint dir (10 steps, a save every 2, the newest 2 kept), shared by the
    retention test and the another-model test (one job for both)."""
    root = tmp_path_factory.mktemp("kept")
    ckpt = root / "ckpt"
    out = run_worker(2, *TINY, "--train-iters", "10", "--save-interval", "2", "--ckpt-keep", "2",
                     "--ckpt-dir", str(ckpt), "--outdir", str(root))  # fmt: skip
    assert out.returncode == 0, out.stderr
    return ckpt


@pytest.mark.slow
def test_retention_keeps_exactly_k(kept):
    assert [(f.step, f.complete) for f in ckpt_files.scan(kept)] == [(8, True), (10, True)]


@pytest.mark.slow
def test_checkpoint_of_another_model_is_a_clear_error(tmp_path, kept):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(kept, ckpt)
    other = run_worker(2, *TINY, "--dim", "64", "--train-iters", "12", "--ckpt-dir", str(ckpt),
                       "--outdir", str(tmp_path), timeout=90)  # fmt: skip
    assert other.returncode == 2
    assert "is of another model (dim=32" in other.stderr
    assert "this run builds dim=64" in other.stderr
    assert "Traceback" not in other.stderr + other.stdout


@pytest.mark.slow
def test_resume_reshards_to_another_world(tmp_path):
    """2 ranks x 2 sequences save at 4, 8 and 12; those past 4 removed, 4 ranks x 1 resume from
    4 (saving 8 and 12); 12 removed, 2 ranks x 2 resume from the 4-rank step 8. The same global
    batch and schedule throughout, so every resumed loss follows the first run's (checkpoints
    change no loss: it is the uninterrupted run) to float tolerance (reduction order differs
    across worlds). (FSDP+TP to FSDP: test_shrink_resume's tensor-parallel case.)"""
    ckpt = tmp_path / "ckpt"
    common = [*TINY, "--train-iters", "12", "--save-interval", "4", "--ckpt-dir", str(ckpt)]
    first = run_worker(2, *common, "--batch-size", "2", "--outdir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stdout + first.stderr
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "a/metrics-0.jsonl")}
    assert sorted(want) == list(range(1, 13))
    for ranks, batch, at in ((4, "1", 4), (2, "2", 8)):
        ckpt_files.remove([f for f in ckpt_files.scan(ckpt) if f.step > at])
        out = tmp_path / f"on-{ranks}"
        again = run_worker(ranks, *common, "--batch-size", batch, "--outdir", str(out))
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"RESUMED from step={at} ({ckpt_files.step_dir(ckpt, at)})" in again.stdout
        got = read_metrics(out / "metrics-0.jsonl")
        assert [r["step"] for r in got] == list(range(at + 1, 13))
        for r in got:
            assert math.isclose(r["loss"], want[r["step"]], rel_tol=1e-4), (ranks, r)
