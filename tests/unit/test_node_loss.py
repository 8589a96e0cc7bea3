"""A lost node: its memory root of its own, the `node_loss` fault's spec and action, and the
keeper's decision to check the nodes again before a relaunch and swap in a spare at once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from contracts import env_names, scratch
from contracts.config_table import ConfigError
from faults import FaultEngine
from faults.spec import JobShape, parse_all
from supervisor.host import memdir, node_check, node_probe
from supervisor.policy import nodes
from supervisor.run.node_keeper import NodeKeeper
from supervisor.watch.rank_table import AttemptTable

SHAPE = JobShape(train_iters=100, save_interval=10, world=6, nodes=3, ranks_per_node=2)


# --- the memory root of each emulated node ----------------------------------------------------
def test_each_emulated_node_has_its_own_memory_root(tmp_path):
    base = {env_names.ENV_MEM_ROOT: str(tmp_path)}
    assert scratch.mem_root({**base, "PMI_HOSTNAME": "n1"}) == str(tmp_path)  # one host per node
    emulated = {**base, env_names.ENV_MEM_PER_NODE: "1"}
    assert scratch.mem_root({**emulated, "PMI_HOSTNAME": "n1"}) == str(tmp_path / "n1")
    assert scratch.mem_root(emulated, "n2") == str(tmp_path / "n2")
    for odd in ("..", "a/b", ""):  # always one directory right under the base
        assert os.path.dirname(scratch.mem_root(emulated, odd)) == str(tmp_path)
    launch_env = {env_names.ENV_MEM_ROOT: str(tmp_path)}
    assert memdir.roots(launch_env, None) == [str(tmp_path)]
    per_node = memdir.roots(launch_env, ["n0", "n1", "n0"])
    assert per_node == [str(tmp_path / "n0"), str(tmp_path / "n1")]


# --- the spec ---------------------------------------------------------------------------------
def test_node_loss_takes_a_node_target():
    (spec,) = parse_all(
        [{"at_step": 5, "action": "node_loss", "target": "node:2"}], "j.toml", SHAPE
    )
    assert spec.action.kind == "node_loss" and str(spec.target) == "node:2"
    assert spec.action.signum == signal.SIGKILL


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"target": "rank:1"}, 'faults[0].target: node_loss takes nodes away: expected "node:N"'),
        ({}, 'node_loss takes nodes away: expected "node:N" or "node:A-B", got \'all\''),
        ({"target": "node:3"}, "faults[0].target: node 3 does not exist: the job has 3 node(s)"),
        ({"target": "node:1-3"}, "faults[0].target: node 3 does not exist: the job has 3 node(s)"),
        ({"target": "node:2-1"}, "the range's last node must come after its first"),
        ({"target": "rank:1-2"}, 'faults[0].target: expected "all", "rank:N", "node:N"'),
        ({"target": "node:x"}, 'faults[0].target: expected "all", "rank:N", "node:N"'),
        ({"target": "node:0", "signal": "TERM"}, "signal: does not apply to action 'node_loss'"),
    ],
)
def test_a_bad_node_loss_is_one_line(extra, says):
    with pytest.raises(ConfigError) as err:
        parse_all([{"at_step": 5, "action": "node_loss", **extra}], "j.toml", SHAPE)
    text = str(err.value)
    assert says in text and "\n" not in text


# --- the action -------------------------------------------------------------------------------
def test_node_loss_kills_the_nodes_ranks_and_takes_its_memory_away(tmp_path):
    env = {env_names.ENV_MEM_ROOT: str(tmp_path), env_names.ENV_MEM_PER_NODE: "1"}
    for n in ("n0", "n1"):
        os.makedirs(scratch.mem_dir(scratch.mem_root(env, n), "job-0123abcd"))
    (spec,) = parse_all(
        [{"at_step": 2, "action": "node_loss", "target": "node:1"}],
        "j.toml",
        JobShape(train_iters=10, world=4, nodes=2, ranks_per_node=2),
    )
    events: list[dict] = []
    standby = AttemptTable(attempt=1, world=4, launched_at=0.0)
    engine = FaultEngine(
        [spec], job_id="job", world=4, ranks_per_node=2, ckpt_dir=None, this_host="h",
        emit=lambda e, **kw: events.append({"event": e, **kw}), control=SimpleNamespace(),
        mem_env=env, others=lambda: [standby],
    )  # fmt: skip
    engine.set_nodes(["n0", "n1"])
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(sleeper) for _ in range(8)]  # 4 ranks, then 4 of the standby
    try:
        table = AttemptTable(attempt=0, world=4, launched_at=0.0)
        for r, p in enumerate(procs[:4]):
            msg = {"attempt": 0, "rank": r, "world": 4, "host": "h", "pid": p.pid, "t": 0.0}
            table.update({**msg, "kind": "hello", "phase": "init"}, 0.0)
            table.update({**msg, "kind": "phase", "phase": "train", "step": 2}, 0.0)
            table.update({**msg, "kind": "step", "step": 2, "loss": 1.0, "dt": 0.1}, 0.0)
        for r, p in enumerate(procs[4:]):
            msg = {"attempt": 1, "rank": r, "world": 4, "host": "h", "pid": p.pid, "t": 0.0}
            standby.update({**msg, "kind": "hello", "phase": "standby"}, 0.0)
        engine.attempt_started(0)
        engine.fire_due(table, 0.0)
        killed = [*procs[2:4], *procs[6:]]
        assert [p.wait(10) for p in killed] == [-signal.SIGKILL] * 4
        assert all(p.poll() is None for p in [*procs[:2], *procs[4:6]])  # node 0's run on
    finally:
        for p in procs:
            p.kill()
            p.wait()
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert fault["action"] == "node_loss" and fault["ranks"] == [2, 3] and fault["node"] == "n1"
    assert fault["mem_root_removed"] == str(tmp_path / "n1") and "errors" not in fault
    assert fault["standby_pids"] == [procs[6].pid, procs[7].pid]
    assert not (tmp_path / "n1").exists() and (tmp_path / "n0").is_dir()
    assert engine.nodes_down() == {"n1"} and engine.ranks_faulted(0) == (2, 3)


def test_a_down_node_does_not_answer_its_check(capsys, monkeypatch):
    monkeypatch.setenv("PMI_HOSTNAME", "n1")
    node_probe.main(["--dirs", "--down", "n1"])
    assert capsys.readouterr().out == ""
    node_probe.main(["--dirs", "--down", "n0"])
    assert capsys.readouterr().out.startswith(node_probe.MARK)


# --- the decision: checked again before the relaunch, a spare at once -------------------------
def test_a_lost_node_in_the_pool_is_checked_again():
    pool = nodes.NodePool(("n0", "n1"), ("n2",))
    assert nodes.recheck_before_relaunch({"n1"}, pool)
    assert not nodes.recheck_before_relaunch(set(), pool)
    assert not nodes.recheck_before_relaunch({"n1"}, nodes.NodePool(("n0", "n2"), (), ("n1",)))


class _Faults:
    def __init__(self, down: set[str]) -> None:
        self.down, self.nodes = frozenset(down), []

    def nodes_down(self):
        return self.down

    def set_nodes(self, names):
        self.nodes = list(names)

    def resize(self, world):
        raise AssertionError("no shrink with a spare left")


def _keeper(tmp_path, down: set[str], emulated: bool = True):
    cfg = SimpleNamespace(
        launch=SimpleNamespace(env={}, ranks_per_node=1, spares=1, emulate_nodes=emulated),
        worker=SimpleNamespace(flags={}),
        restart=SimpleNamespace(exclude_after=5, shrink=False, min_nodes=1),
    )
    resolved = SimpleNamespace(
        cfg=cfg,
        nodes=["n0", "n1", "n2", "n3"],
        pool=nodes.NodePool(("n0", "n1", "n2"), ("n3",)),
        kind=SimpleNamespace(this_host_only=False),
        write_hostfile=lambda: None,
    )
    events: list[dict] = []
    faults = _Faults(down)
    keeper = NodeKeeper(resolved, lambda e, **kw: events.append({"event": e, **kw}), faults)
    return keeper, resolved, faults, events


def test_a_lost_node_is_swapped_for_the_spare_at_once(tmp_path, monkeypatch):
    asked: list = []

    async def run_on(resolved, every, dirs, timeout, down=(), each=False):
        asked.append(sorted(down))
        report = node_probe.MARK + '{{"node": "{}", "problems": []}}'
        return [report.format(n) for n in every if n not in down]

    monkeypatch.setattr(node_check, "run_on", run_on)
    keeper, resolved, faults, events = _keeper(tmp_path, {"n1"})
    assert faults.nodes == ["n0", "n1", "n2"]
    assert keeper.count_failure(nodes.Attribution("n1", (1,), "injected"), 0) is None
    assert asyncio.run(keeper.recheck(0)) is None
    assert asked == [["n1"]]
    assert resolved.pool.active == ("n0", "n3", "n2") and resolved.pool.excluded == ("n1",)
    assert faults.nodes == ["n0", "n3", "n2"] and keeper.just_excluded == ["n1"]
    (excluded,) = [e for e in events if e["event"] == "node_excluded"]
    assert excluded["reason"].startswith("node check before relaunch: no report")
    assert excluded["attempt"] == 0 and excluded["count"] == 1  # below exclude_after = 5
    assert [e for e in events if e["event"] == "node_swapped"][0]["into"] == "n3"
    assert asyncio.run(keeper.recheck(1)) is None and len(asked) == 1  # out: no check again


def test_a_check_no_node_answered_is_tried_again(tmp_path, monkeypatch):
    answers = [[], None]  # the launcher failed, then every node but the lost one answers

    async def run_on(resolved, every, dirs, timeout, down=(), each=False):
        if answers.pop(0) is not None:
            return []
        report = node_probe.MARK + '{{"node": "{}", "problems": []}}'
        return [report.format(n) for n in every if n not in down]

    monkeypatch.setattr(node_check, "run_on", run_on)
    keeper, resolved, _, events = _keeper(tmp_path, {"n1"})
    assert asyncio.run(keeper.recheck(0)) is None and answers == []
    assert [e["reported"] for e in events if e["event"] == "node_check"] == [0, 3]
    assert resolved.pool.active == ("n0", "n3", "n2")


def test_a_host_whose_ranks_went_silent_is_checked_alone_and_swapped(tmp_path, monkeypatch):
    """Real hosts: a hang laid on n1 (its host died) has the nodes checked; one launch for all
    says nothing (Hydra over ssh fails as a whole for a host that does not answer), each node
    alone then answers but n1."""
    asked: list = []

    async def run_on(resolved, every, dirs, timeout, down=(), each=False):
        asked.append(each)
        report = node_probe.MARK + '{{"node": "{}", "problems": []}}'
        return [report.format(n) for n in every if n != "n1"] if each else []

    monkeypatch.setattr(node_check, "run_on", run_on)
    keeper, resolved, _, events = _keeper(tmp_path, set(), emulated=False)
    assert asyncio.run(keeper.recheck(0)) is None and asked == []  # nothing silent: no check
    assert asyncio.run(keeper.recheck(0, silent_node="n1")) is None
    assert asked == [False, True]
    assert resolved.pool.active == ("n0", "n3", "n2") and resolved.pool.excluded == ("n1",)
    assert [e["reported"] for e in events if e["event"] == "node_check"] == [3]


def test_no_node_lost_no_check_before_a_relaunch(tmp_path, monkeypatch):
    async def run_on(*args, **kwargs):
        raise AssertionError("no check")

    monkeypatch.setattr(node_check, "run_on", run_on)
    keeper, resolved, _, events = _keeper(tmp_path, set())
    assert asyncio.run(keeper.recheck(0)) is None and events == []
