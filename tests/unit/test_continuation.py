"""Continuing a job in its run dir (issue 39 item 1, issue 40 item 4): what changed since the run
it continues, the changes refused unless allowed, the run dirs with nothing to continue, the
job's id and memory directory kept, and the command printed after exit 3, 4, 5 and 6. The
end-to-end run (SIGINT, then the printed command, bit-exact) is tests/e2e/test_continue_e2e.py.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from contracts import env_names
from contracts.exit_codes import ExitCode
from supervisor.commands import cli, continuing
from supervisor.launch.resolve import Resolved, resolve
from supervisor.policy import continuation
from supervisor.run.job import Job
from supervisor.settings import loading, toml_dump
from tests.support import TINY_JOB_WORKER, one_line_error, toml_table
from tests.unit.test_job import MEM, FakeLauncher, Script, hello_steps, named, run

JOB = "t-1234abcd"


def job_config(tmp_path: Path, **worker) -> Path:
    text = toml_table("[job]", {"name": "t", "run_dir": str(tmp_path / "run")})
    text += toml_table("[launch]", {"launcher": "local", "ranks_per_node": 2})
    text += toml_table("[worker]", {**TINY_JOB_WORKER, "train_iters": 24, **worker})
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def ran_before(tmp_path: Path, ended: str = "INTERRUPTED", **worker) -> Path:
    """The run dir a supervisor left: its resolved config.toml and events that end `ended`."""
    resolved = resolve(loading.load(job_config(tmp_path, **worker)))
    run = resolved.run_dir
    run.mkdir(parents=True)
    (run / "config.toml").write_text(toml_dump.dumps(resolved.resolved_dict()))
    evs = [
        {"event": "start", "job": JOB, "world": 2, "max_restarts": 10, "ts": 1.0, "mono": 1.0},
        {"event": "done", "attempt": 0, "step": 24, "ts": 8.0, "mono": 8.0},
        {"event": "supervisor_exit", "code": 0, "code_name": ended, "ts": 9.0, "mono": 9.0},
    ]
    if ended != "DONE":
        evs.pop(1)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    return run


def dry(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(["run", *argv, "--dry-run"])
    got = capsys.readouterr()
    return rc, got.err


# --- what changed, what breaks a bit-exact resume -------------------------------------------
def test_only_what_a_step_computes_breaks_a_bit_exact_resume() -> None:
    for key in ("worker.train_iters", "worker.lr", "worker.dim", "worker.seed", "worker.data_path",
                "worker.batch_size", "worker.tp", "worker.ckpt_dir", "worker.module", "world",
                "worker.my_own_flag"):  # fmt: skip
        assert continuation.breaks(key), key
    harmless = ("restart.max_restarts", "heartbeat.timeout_s", "launch.nodes", "faults",
                "worker.save_interval", "worker.mem_ckpt_interval", "worker.log_every")  # fmt: skip
    for key in harmless:
        assert continuation.breaks(key) is None, key
    old = {"worker": {"lr": 0.1, "seed": 1}, "restart": {"max_restarts": 10}}
    new = {"worker": {"lr": 0.1}, "restart": {"max_restarts": 3}, "job": {"run_dir": "x"}}
    got = continuation.differences(old, new, 4, 2)
    assert [(c.key, c.old, c.new) for c in got] == [
        ("world", 4, 2), ("restart.max_restarts", 10, 3), ("worker.seed", 1, None)]  # fmt: skip
    assert [c.key for c in continuation.refused(got, ["world"])] == ["worker.seed"]


def test_a_continuation_with_nothing_changed_lists_nothing(tmp_path, capsys) -> None:
    run = ran_before(tmp_path)
    rc, err = dry(capsys, "--resume", str(run))
    assert rc == 0, err
    assert f"continuing job {JOB} in {run} (supervisor 2; the last ended: INTERRUPTED)" in err
    assert "changed:" not in err


def test_a_changed_schedule_is_refused_in_one_line(tmp_path, capsys) -> None:
    """Before: a job continued with train_iters 1500 -> 500 was accepted without a word."""
    run = ran_before(tmp_path)
    err = one_line_error(capsys, ["run", "--resume", str(run), "--set", "worker.train_iters=12"])
    assert (
        f"continuing job {JOB} with worker.train_iters: 24 -> 12 breaks a bit-exact resume (the "
        "learning-rate schedule depends on it); keep it as it was, or allow it with "
        "--allow-change worker.train_iters"
    ) in err
    # the same change by the config file, run again on its run dir: refused alike
    job_config(tmp_path, train_iters=12)
    err = one_line_error(capsys, ["run", str(tmp_path / "job.toml")])
    assert "worker.train_iters: 24 -> 12 breaks a bit-exact resume" in err
    err = one_line_error(capsys, ["run", "--resume", str(run), "--set", "launch.ranks_per_node=1"])
    assert "world: 2 -> 1 breaks a bit-exact resume (the number of ranks" in err


def test_an_allowed_change_is_listed_and_a_harmless_one_needs_no_leave(tmp_path, capsys) -> None:
    run = ran_before(tmp_path)
    more = ["--set", "restart.max_restarts=3", "--allow-change", "worker.train_iters"]
    rc, err = dry(capsys, "--resume", str(run), "--set", "worker.train_iters=12", *more)
    assert rc == 0, err
    assert "  changed: restart.max_restarts: 10 -> 3\n" in err
    assert (
        "  changed: worker.train_iters: 24 -> 12 (allowed: the learning-rate schedule depends on "
        "it)"
    ) in err


def test_run_dirs_with_nothing_to_continue_are_one_line(tmp_path, capsys) -> None:
    err = one_line_error(capsys, ["run", "--resume", str(tmp_path)])
    assert "holds no config.toml, so no job to continue" in err
    (tmp_path / "done").mkdir()
    done = ran_before(tmp_path / "done", ended="DONE")
    err = one_line_error(capsys, ["run", "--resume", str(done)])
    assert "the job finished (DONE at step 24): nothing to continue; to train further" in err
    assert "no CONFIG" not in one_line_error(capsys, ["run"])


# --- the job itself -------------------------------------------------------------------------
def test_a_continued_job_keeps_its_id_and_takes_up_its_memory_copies(
    tmp_path, mem_root, monkeypatch
) -> None:
    """A supervisor killed outright leaves its memory directory; the job continued takes it up
    (held before the start's sweep, which would else remove it as abandoned)."""
    monkeypatch.setenv(env_names.ENV_MEM_ROOT, str(mem_root))
    left = mem_root / f"es-mem-{JOB}"
    (left / "rank-0").mkdir(parents=True)
    (left / "rank-0" / "slot-0.bin").write_bytes(b"x" * 64)
    cfg = loading.from_dict({"job": {"name": "t", "run_dir": str(tmp_path / "run")},
                             "worker": MEM, "restart": {"standby": False}})  # fmt: skip
    resolved = Resolved(cfg, tmp_path / "run", [socket.gethostname()], sys.executable, "local")
    fake = FakeLauncher(Script(rc=0, says=hello_steps(21, 22, resumed=20, done=True)))
    facts = {"lifetime": 2, "after": "no final event", "changes": [], "allowed": []}
    job = Job(resolved, console=None, launcher=fake, job_id=JOB, continued=facts)
    seen = []
    start = fake.start

    async def look(plan, *args):
        seen.append((left / "rank-0" / "slot-0.bin").is_file())
        return await start(plan, *args)

    fake.start = look
    code, evs = run(job)
    assert code == ExitCode.DONE and seen == [True]
    assert named(evs, "start")[0]["job"] == JOB and named(evs, "start")[0]["continues"]
    (said,) = named(evs, "continued")
    assert {k: said[k] for k in facts} == facts
    assert [e["path"] for e in named(evs, "mem_held")] == [str(left)]
    assert not named(evs, "mem_sweep")
    assert fake.started[0].plan.procs[0].env["ES_JOB_ID"] == JOB


# --- what `run` prints when a job ends without finishing --------------------------------------
def ended_with(tmp_path: Path, give_up: dict, *more: dict) -> Path:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    evs = [
        {"event": "start", "job": JOB, "max_restarts": 4},
        *more,
        {"event": "give_up", **give_up},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    return run


def test_exit_3_4_5_and_6_print_the_command_that_continues_the_job(tmp_path) -> None:
    failed = {"event": "attempt_end", "attempt": 4, "outcome": "failure", "detail": "exit 1"}
    saved = {"event": "ckpt_complete", "attempt": 0, "step": 150}
    cases = {
        "INTERRUPTED": ({}, "nothing needs to change: it resumes from its checkpoint at step 150"),
        "BUDGET": ({}, "find why its attempts failed and fix that (the last: exit 1): continued "
                       "as it is, it gets a new budget of 4 restarts"),
        "NO_PROGRESS": ({"reason": "3 attempts in a row resumed from step 0"},
                        "fix what kept it from progressing (3 attempts in a row resumed from "
                        "step 0) (the last: exit 1)"),
        "NODES": ({"nodes": {"active": ["n0"], "spares": [], "excluded": ["n1"]},
                   "reason": "n1 excluded and no spare node left"},
                  "give it good nodes: n1 failed (n1 excluded and no spare node left); check or "
                  "replace them (--set launch.nodes=[...])"),
    }  # fmt: skip
    for code, (facts, first) in cases.items():
        run = ended_with(tmp_path / code, {"code_name": code, **facts}, saved, failed)
        lines = continuing.hint_lines(run)
        assert lines[0] == f"Continue: python -m supervisor run --resume {run}", code
        assert lines[1].startswith(f"  first: {first}"), (code, lines[1])
    run = ended_with(tmp_path / "diverged", {"code_name": "DIVERGED"})
    assert continuing.hint_lines(run) == []


def test_a_run_dir_that_lost_its_config_is_compared_by_its_world_only(tmp_path, capsys) -> None:
    run = ran_before(tmp_path)
    (run / "config.toml").unlink()
    rc, err = dry(capsys, str(tmp_path / "job.toml"), "--resume", str(run))
    assert rc == 0, err
    assert "config.toml is missing: its settings are not compared (only the world)" in err
    err = one_line_error(capsys, ["run", str(tmp_path / "job.toml"), "--resume", str(run),
                                  "--set", "launch.ranks_per_node=1"])  # fmt: skip
    assert "world: 2 -> 1 breaks a bit-exact resume" in err
