"""faults/ with a process: the shipped configs through `validate` (it runs `mpiexec --version`),
and the engine signalling a real local process. The rest is in unit/test_faults.py."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from faults import spec as fault_spec
from supervisor.commands import cli
from supervisor.settings import loading
from tests.support import REPO, fake_checkpoints

# --- parsing --------------------------------------------------------------------------------------


def test_shipped_configs_with_faults_validate(capsys, monkeypatch):
    # validate checks the launcher exists; the mpich wheel puts mpiexec beside this python.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for name in ("debug.toml", "chaos.toml"):
        assert cli.main(["validate", str(REPO / "configs" / name)]) == 0, capsys.readouterr().err
    (f,) = loading.load(REPO / "configs" / "agpt2b.toml").faults  # parsed once, typed, as loaded
    assert f.trigger.at_step == (500, 1000, 1500) and f.trigger.after_checkpoint
    assert f.table["at_step"] == [500, 1000, 1500]  # ... and the table as given, for the dump
    chaos = loading.load(REPO / "configs" / "chaos.toml").faults
    # Every action (a kill twice: by time and during a save); a network partition needs the
    # test bed (testbed/), not this host.
    kinds = {s.action.kind for s in chaos}
    assert kinds == set(fault_spec.ACTIONS) - {"partition"}, sorted(kinds)


# --- the engine against a real process (no torch: a `sleep` stands in for a rank) ----------------
def test_engine_signals_a_local_rank_and_writes_one_fault_event(tmp_path):
    import subprocess

    from supervisor.launch import hosts
    from supervisor.run import fault_hooks
    from supervisor.watch.rank_table import AttemptTable

    cfg = loading.from_dict(
        {
            "launch": {"ranks_per_node": 2},
            "worker": {"train_iters": 50, "save_interval": 5, "ckpt_dir": str(tmp_path)},
            "faults": [
                {"at_step": 7, "after_checkpoint": True, "action": "corrupt", "target": "rank:1"}
            ],
        }
    )
    fake_checkpoints(tmp_path, steps=(5, 10))
    emitted = []
    engine = fault_hooks.for_job(cfg, 2, "k" * 64, "job", "tcp://127.0.0.1:1",
                                 lambda e, **kw: emitted.append({"event": e, **kw}))  # fmt: skip
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        assert engine.control.address.startswith("tcp://127.0.0.1:")
        table = AttemptTable(attempt=0, world=2, launched_at=0.0)
        engine.attempt_started(0)
        host = hosts.this_host()
        for r, p in enumerate(ranks):
            msg = {"attempt": 0, "rank": r, "world": 2, "host": host, "pid": p.pid, "t": 0.0}
            table.update({**msg, "kind": "hello", "phase": "init"}, 1.0)
            table.update({**msg, "kind": "phase", "phase": "train", "step": 0}, 1.0)
        step0 = {"attempt": 0, "rank": 0, "world": 2, "host": host, "pid": ranks[0].pid}
        for step in range(1, 11):
            m = {**step0, "t": 0.0, "kind": "step", "step": step, "loss": 1.0, "dt": 0.1}
            table.update(m, 2.0)
            engine.on_message(m, table, 2.0)
        assert emitted == []  # step 10 reached, its checkpoint not complete yet
        m = {**step0, "t": 0.0, "kind": "ckpt", "step": 10, "state": "complete"}
        table.update(m, 2.0)
        engine.on_message(m, table, 2.0)
        (event,) = emitted
        assert ranks[1].wait(10) == -signal.SIGKILL and ranks[0].poll() is None
        assert event["event"] == "fault" and event["action"] == "corrupt"
        assert event["ranks"] == [1] and event["pids"] == [ranks[1].pid]
        assert event["via"] == ["signal"] and event["signal"] == "SIGKILL"
        assert event["point"] == {"step": 7} and event["step"] == 10 and event["steps"] == [0]
        assert event["damaged"]["step"] == 10 and event["damaged"]["file"] == "__1_0.distcp"
        assert event["marker"]["step"] == 10 and event["marker"]["mtime"] <= event["ts"]
        engine.fire_due(table, 3.0)
        assert len(emitted) == 1  # the attempt is over for faults
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        engine.close()
    assert emitted[-1] == {"event": "fault_summary", "total": 1, "fired": {"faults[0]": 1}}
