"""The numerical guard end to end (tiny model, 2 ranks, real mpiexec).

- The worker alone: bad steps injected into rank 0 (a spiked loss, a NaN gradient) never reach
  the weights: the run goes on, skipping one (no checkpoint yet) and rolling the other back to
  the durable checkpoint, and every loss equals that of a run given `--skip-batches` with the
  ranges it skipped, bit for bit.
- Under the supervisor: a `spike` fault from the config, caught by the guard and rolled back to
  the memory tier's copy in the ranks' own processes, is one `numeric_fault` and one
  `rollback` event, shown by `tail` and in the report's table; the job ends in one attempt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import (
    TINY,
    TINY_JOB_WORKER,
    events,
    inject_env,
    losses,
    rank_env,
    read_metrics,
    run_supervisor,
    run_worker,
    supervisor_cli,
    toml_table,
)

pytestmark = pytest.mark.slow

STEPS = ["--train-iters", "14", "--log-every", "14"]


def worker(tmp_path: Path, name: str, *flags: str, env: dict | None = None) -> Path:
    out = tmp_path / name
    run = run_worker(2, *TINY, *STEPS, "--outdir", str(out), *flags, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    (out / "stdout.txt").write_text(run.stdout)
    return out


def test_bad_steps_never_reach_the_weights_and_later_losses_match_a_run_given_the_ranges(tmp_path):
    """One guarded run, two bad steps: a spike at step 3, before any checkpoint (so rollback
    falls back to skip: position 3 alone), and a NaN at step 9, rolled back to the durable
    checkpoint of step 6 (positions 8-10: step 6 trained position 7)."""
    ckpt = tmp_path / "ckpt"
    faults = rank_env(**inject_env(rank=0, spike_at_step=3, nan_at_step=9))
    # the memory tier off: its copy of step 1 or 2 would serve the rollback at step 3
    guarded = worker(
        tmp_path, "guarded", "--guard", "rollback", "--guard-warmup", "1", "--ckpt-dir",
        str(ckpt), "--save-interval", "6", "--mem-ckpt-interval", "0", env=faults,
    )  # fmt: skip
    said = (guarded / "stdout.txt").read_text()
    assert "GUARD: step 3 not applied: spike" in said
    assert "GUARD: no checkpoint to roll back to: skipping the batch instead" in said
    assert "GUARD: data position 3 skipped; step 3 redone" in said
    assert "GUARD: step 9 not applied: nan" in said
    assert "GUARD: rolled back to step 6 (durable); data positions 8-10 skipped" in said
    records = read_metrics(guarded / "metrics-0.jsonl")
    # no bad step is recorded; steps 7 and 8 ran twice (before the NaN and after the rollback)
    assert [r["step"] for r in records] == [*range(1, 9), *range(7, 15)]
    meta = json.loads((ckpt / "step-14" / "meta.json").read_text())
    assert meta["data"]["skip"] == "3-3,8-10"

    given = losses(worker(tmp_path, "given", "--skip-batches", "3-3,8-10") / "metrics-0.jsonl")
    after = {r["step"]: r["loss"] for r in records}  # a later record of a step replaces one
    assert after == given  # bit for bit: every step, and every step after the rollback
    assert all(r["loss"] == given[r["step"]] for r in records[:6])  # before any fault too


def test_a_spike_fault_is_caught_rolled_back_and_reported(tmp_path):
    run = tmp_path / "run"
    text = toml_table("[job]", {"name": "g", "run_dir": str(run)})
    text += toml_table("[launch]", {"launcher": "mpiexec", "ranks_per_node": 2})
    text += toml_table("[launch.env]", {"OMP_NUM_THREADS": "1"})
    text += toml_table(
        "[worker]",
        {**TINY_JOB_WORKER, "train_iters": 24, "save_interval": 5, "mem_ckpt_interval": 1},
    )
    text += toml_table("[restart]", {"standby": False})
    text += toml_table("[guard]", {"action": "rollback", "warmup": 6})
    text += toml_table(
        "[[faults]]", {"name": "spike-r1", "at_step": 12, "action": "spike", "target": "rank:1"}
    )
    (tmp_path / "job.toml").write_text(text)
    code, out = run_supervisor(tmp_path / "job.toml", 240)
    assert code == 0, out[-4000:]

    evs = events(run)
    (fault,) = [e for e in evs if e["event"] == "numeric_fault"]
    (back,) = [e for e in evs if e["event"] == "rollback"]
    assert (fault["kind"], fault["ranks"], fault["what"], fault["action"]) == (
        "spike", [1], "loss", "rollback",
    )  # fmt: skip
    assert fault["step"] == 12 and fault["value"] > 0  # at the point itself (issue 40)
    # the memory tier's copy of the step before (or the one before it), newer than durable 10
    to = back["to_step"]
    assert back["from_step"] == fault["step"] and fault["step"] - 2 <= to < fault["step"]
    assert back["skip"] == f"{to + 1}-{fault['step']}"
    output = (run / "attempts" / "000" / "output.log").read_text()
    assert f"GUARD: rolled back to step {to} (memory)" in output
    assert [e["attempt"] for e in evs if e["event"] == "launch"] == [0]  # no relaunch

    tail = supervisor_cli("tail", str(run)).stdout
    assert "numeric_fault" in tail and "rollback" in tail
    report = (run / "report.md").read_text()
    assert "## Numerical guard" in report
    assert f"| numeric_fault | {fault['step']} | spike |" in report
    assert (
        f"| rollback | {fault['step']} | rollback | – | – | to step {to}, skip {back['skip']} |"
        in report
    )
    assert "1 bad step(s) caught and not applied; 1 rollback(s)." in report
