"""Prepared ranks ([restart] warm_spare): whether a job keeps them, which become an attempt's
ranks, and the launches of several nodes watched as one (real processes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from contracts import control_msgs, messages
from supervisor.launch.launch_group import LaunchGroup
from supervisor.launch.plan import LaunchPlan, ProcSpec
from supervisor.launch.processes import Launched, helper_process
from supervisor.launch.registry import launcher_for
from supervisor.launch.resolve import Resolved
from supervisor.policy import prepared_rules
from supervisor.policy.liveness import RankState, judge_ranks
from supervisor.run.prepared import Adopted, PreparedRanks, become
from supervisor.settings import loading
from supervisor.settings.config import HeartbeatConfig

KEEPS = dict(wanted=True, standby_off=None, spares=1, launcher_cannot=None, module="worker.train")


def test_kept_only_with_a_spare_a_standby_and_a_launcher_that_can():
    assert prepared_rules.unavailable(**KEEPS) is None
    for change, why in (
        ({"wanted": False}, "restart.warm_spare is false"),
        ({"standby_off": "restart.standby is false"}, "restart.standby is false"),
        ({"spares": 0}, "no spare node (launch.spares = 0)"),
        ({"launcher_cannot": "srun cannot"}, "srun cannot"),
        ({"module": "my.trainer"}, "worker module my.trainer has no prepared form"),
    ):
        assert prepared_rules.unavailable(**{**KEEPS, **change}).startswith(why), change


def test_hydra_and_srun_start_one_node_on_its_own():
    assert launcher_for("mpiexec").node_launches("hydra") is None
    assert "Hydra" in launcher_for("mpiexec").node_launches("pals")
    assert launcher_for("srun").node_launches("srun") is None  # a step on one node
    assert launcher_for("local").node_launches("local") is not None


def test_each_node_of_the_new_list_gives_its_waiting_ranks_in_rank_order():
    ready = {"n0": [0, 1], "n1": [2, 3], "n2": [4, 5], "n3": [6, 7]}
    # n1 lost, the spare n3 in its place: rank 2 and 3 are n3's.
    assert prepared_rules.placement(["n0", "n3", "n2"], ready, 2) == [0, 1, 6, 7, 4, 5]
    short = {**ready, "n3": [6]}  # one of the spare's still importing
    assert prepared_rules.placement(["n0", "n3"], short, 2) == (
        "no prepared ranks ready on n3 (1 of 2)"
    )
    assert prepared_rules.placement(["n9"], ready, 2).startswith("no prepared ranks ready on n9")


def test_a_become_carries_string_variables_only():
    key = b"k" * 32
    become = control_msgs.control_message("job", 0, 1, 1.0, "become", 0, env={"RANK": "1"})
    frame = messages.encode(key, become)
    assert control_msgs.decode_control(key, frame, "job", 0, 1)["env"] == {"RANK": "1"}
    for env in ({"RANK": 1}, {"RANK": ["1"]}, [], {f"V{i}": "" for i in range(257)}):
        frame = messages.encode(key, {**become, "env": env})
        with pytest.raises(messages.BadMessage):
            control_msgs.decode_control(key, frame, "job", 0, 1)


def _launch(code: str, label: str) -> LaunchPlan:
    return LaunchPlan("local", [ProcSpec([sys.executable, "-c", code], {}, label)], 1, [label])


def test_launch_group_waits_for_all_or_the_first_failure(tmp_path):
    async def scenario():
        ok = [await Launched.start(_launch("pass", f"n{i}"), tmp_path / f"{i}.log") for i in (0, 1)]
        clean = await asyncio.wait_for(LaunchGroup(ok, 0.0).wait(), 30)
        failing = [
            await Launched.start(_launch("import time; time.sleep(60)", "n0"), tmp_path / "a.log"),
            await Launched.start(_launch("raise SystemExit(3)", "n1"), tmp_path / "b.log"),
        ]
        group = LaunchGroup(failing, 0.0)
        first = await asyncio.wait_for(group.wait(), 30)
        result = await group.teardown(0.5)
        return clean, first, result, group

    clean, first, result, group = asyncio.run(scenario())
    assert clean.returncode == 0
    assert first.returncode == 3  # the other node's launch still ran: the first failure ends it
    assert not result.survivors and result.terminated >= 1
    assert group.plan.nodes == ["n0", "n1"] and group.plan.world == 2


@pytest.mark.parametrize("emulated", [True, False])
def test_one_node_s_launch_names_only_that_node(tmp_path, emulated):
    """A prepared launch of one node: Hydra places it by name, never by the job's host file."""
    launch = {"launcher": "mpiexec", "nodes": ["a", "b", "c"], "spares": 1}
    launch["emulate_nodes"] = emulated
    cfg = loading.from_dict({"launch": launch, "worker": {"model": "debug"}})
    resolved = Resolved(cfg, tmp_path, ["a", "b", "c"], "/usr/bin/mpiexec", "hydra")
    argv = resolved.prepared_plan({}, "c").procs[0].argv
    assert argv[argv.index("-hosts") + 1] == "c" and "-f" not in argv
    assert argv[argv.index("-n") + 1] == "1"
    at = argv.index("-m") + 1  # forked by the node's template (the default)
    assert argv[at : at + 2] == ["worker.template_client", "worker.prepared"]


# --- the keeper: launch per node, take, end (real processes as the prepared ranks) -------------
WAITS = "import time; time.sleep(60)"


def fake_job(tmp_path, nodes, spares, emitted):
    """What the keeper reads of a job: two nodes' worth of resolved config, a launcher that
    starts a sleeping process per node, a control channel that records its words."""
    told: list[tuple[int, int, str, dict]] = []
    launch = SimpleNamespace(ranks_per_node=1, cwd=None, emulate_nodes=True)

    class Launcher:
        async def start(self, plan, output, cwd, on_rank_exit):
            return await Launched.start(plan, output)

    resolved = SimpleNamespace(
        cfg=SimpleNamespace(launch=launch),
        pool=SimpleNamespace(active=nodes, spares=spares),
        worker_overrides={},
        run_dir=tmp_path,
        prepared_plan=lambda env, node: _launch(WAITS, node),
    )
    control = SimpleNamespace(
        command=lambda a, r, action, t, env=None: told.append((a, r, action, env)) and None,
        forgotten=[],  # the attempts whose identities it let go
    )
    control.forget = control.forgotten.append
    job = SimpleNamespace(
        resolved=resolved,
        launcher=Launcher(),
        rank_env=lambda number, folder, standby: {"ES_ATTEMPT": str(number)},
        emit=lambda event, **f: emitted.append((event, f)),
        control=control,
        faults=SimpleNamespace(nodes_down=lambda: frozenset({"gone"})),
    )
    return job, told


def say_waiting(keeper, ranks):
    """Each of `ranks` says hello, then that it waits (as worker.prepared does)."""
    for r in ranks:
        common = {"attempt": keeper.number, "rank": r, "t": time.time(), "host": "h", "pid": 1,
                  "world": 3}  # fmt: skip
        keeper.on_message({**common, "kind": "hello", "phase": "init"}, time.monotonic())
        keeper.on_message(
            {**common, "kind": "phase", "phase": "standby", "step": 0}, time.monotonic()
        )


def test_the_keeper_gives_the_new_node_list_its_ranks_and_ends_the_rest(tmp_path):
    emitted: list = []

    async def scenario():
        job, told = fake_job(tmp_path, ["n0", "n1", "gone"], ["n2"], emitted)
        keeper = PreparedRanks(job, lambda: 7, lambda: True)
        keeper.ensure()
        await keeper._task
        assert keeper.number == 7 and list(keeper.launches) == ["n0", "n1", "n2"]
        say_waiting(keeper, [0, 2])  # n1's not yet waiting
        assert keeper.ready() == {"n0": [0], "n1": [], "n2": [2]}
        adopted, why = keeper.take(["n0", "n2"])  # n1 lost, its place taken by n2
        assert why is None and adopted.chosen == [0, 2] and adopted.nodes == ["n0", "n2"]
        assert keeper.number is None and keeper.launches == {}  # none kept after a take
        await keeper.close("job over")  # n1's, not taken, ended (told exit first)
        assert (7, 1, "exit", {}) in [(a, r, act, e or {}) for a, r, act, e in told]
        assert job.control.forgotten == []  # let go once the taken ones are told to become
        await adopted.group.teardown(0.0)
        return adopted

    adopted = asyncio.run(scenario())
    names = [e for e, _ in emitted]
    assert names[:1] == ["prepared_launch"] and "prepared_ready" not in names
    assert [f["node"] for e, f in emitted if e == "prepared_exit"] == ["n1"]
    assert not [p for p in adopted.group.pids if psutil.pid_exists(p)]


def test_ready_is_said_once_every_node_s_ranks_wait_and_never_with_a_launch_ended(tmp_path):
    """`prepared_ready` says every prepared rank waits: not while one node's still starts, and
    not at all once a node's launch ended first (`prepared_lost` said that one)."""

    async def scenario(lose: bool) -> list[str]:
        emitted: list = []
        job, _ = fake_job(tmp_path, ["n0", "n1"], ["n2"], emitted)
        keeper = PreparedRanks(job, lambda: 5, lambda: True)
        keeper.ensure()
        await keeper._task
        say_waiting(keeper, [0, 2])
        assert "prepared_ready" not in [e for e, _ in emitted]  # n1's not yet
        if lose:
            run = keeper.launches["n1"]
            for pid in run.pids:
                os.kill(pid, 9)
            await run.wait()
            await asyncio.sleep(0.05)  # its watch says it lost
        say_waiting(keeper, [1])
        await keeper.close("job over")
        return [e for e, _ in emitted]

    said = asyncio.run(scenario(lose=False))
    assert said.count("prepared_ready") == 1
    said = asyncio.run(scenario(lose=True))
    assert "prepared_lost" in said and "prepared_ready" not in said


def test_a_node_not_all_waiting_sends_the_relaunch_cold_and_ends_every_one(tmp_path):
    emitted: list = []

    async def scenario():
        job, _ = fake_job(tmp_path, ["n0", "n1"], ["n2"], emitted)
        keeper = PreparedRanks(job, lambda: 4, lambda: True)
        keeper.ensure()
        await keeper._task
        pids = [p for run in keeper.launches.values() for p in run.pids]
        say_waiting(keeper, [0, 1])
        got = keeper.take(["n0", "n2"])
        await keeper.close("job over")
        assert job.control.forgotten == [4]  # all told to exit: 4/r claimed no more
        return got, pids

    (adopted, why), pids = asyncio.run(scenario())
    assert adopted is None and why == "no prepared ranks ready on n2 (0 of 1)"
    assert sorted(f["node"] for e, f in emitted if e == "prepared_exit") == ["n0", "n1", "n2"]
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_ranks_told_to_become_owe_a_hello_within_seconds_not_the_init_timeout():
    """A `become` lost (its routing id taken by another peer, say) is judged after HELLO_S."""
    heard = {0: RankState(0, last_seen=5.0, last_progress=5.0, phase="load")}
    hb = HeartbeatConfig()
    assert judge_ranks(heard, 2, now=5.0, launched_at=0.0, heartbeat=hb, hello_s=10.0) is None
    late = judge_ranks(heard, 2, now=10.5, launched_at=0.0, heartbeat=hb, hello_s=10.0)
    assert late is not None and late.ranks == (1,) and late.deadline == 10.0
    assert late.reason == "no hello within 10 s of the word to become these ranks"
    assert judge_ranks(heard, 2, now=10.5, launched_at=0.0, heartbeat=hb) is None  # launched


def test_a_become_names_the_rank_and_never_carries_the_key(tmp_path):
    emitted: list = []
    job, told = fake_job(tmp_path, ["n0", "n2"], [], emitted)
    job.rank_env = lambda number, folder, standby: {
        "ES_ATTEMPT": str(number), "ES_HEARTBEAT_KEY": "secret", "ES_JOB_ID": "j",
    }  # fmt: skip
    group = SimpleNamespace(teardown=None)  # a teardown only where a word cannot be sent
    adopted = Adopted(7, group, [4, 1], ["n0", "n2"], 1)
    why = asyncio.run(become(adopted, job, 9, tmp_path / "009", lambda *a, **k: None))
    assert why is None
    assert [(a, r, action) for a, r, action, _ in told] == [(7, 4, "become"), (7, 1, "become")]
    first, second = (env for *_, env in told)
    assert "ES_HEARTBEAT_KEY" not in first and first["ES_ATTEMPT"] == "9"
    assert (first["RANK"], second["RANK"], first["WORLD_SIZE"]) == ("0", "1", "2")
    assert first["MASTER_ADDR"] == "127.0.0.1" and first["MASTER_PORT"] == second["MASTER_PORT"]
    assert "prepared ranks of attempt 7" in (tmp_path / "009" / "command.txt").read_text()
    assert job.control.forgotten == [7]  # they are attempt 9's ranks now: 7/r claimed no more


def test_a_teardown_leaves_the_supervisor_s_own_helpers_alone(tmp_path):
    """The node check runs beside a standby's end: its processes are not the standby's orphans."""

    async def scenario():
        helper = subprocess.Popen([sys.executable, "-c", WAITS], start_new_session=True)
        try:
            run = await Launched.start(_launch(WAITS, "n0"), tmp_path / "a.log")
            with helper_process(helper.pid):
                result = await run.teardown(0.2)
            return result, helper.poll()
        finally:
            helper.kill()
            helper.wait()

    result, helper_rc = asyncio.run(scenario())
    assert helper_rc is None and not result.survivors  # the helper ran on, and was not counted


def test_a_prepared_rank_started_by_hand_says_what_it_is_for():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ES_")}
    run = subprocess.run(
        [sys.executable, "-m", "worker.prepared"], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("error: worker.prepared waits for the supervisor's word")
