"""Launcher kinds, their commands and hydra's output lines, pure. The real process handling
(exit detection, teardown, no orphans) is in e2e/test_launcher_processes.py."""

from __future__ import annotations

import sys
import typing

import pytest

from supervisor.launch import hosts
from supervisor.launch.hydra_lines import HydraLines
from supervisor.launch.kinds import LauncherMissing
from supervisor.launch.registry import KINDS, launcher_for
from supervisor.settings import config as C
from supervisor.settings import loading


def cfg(**launch):
    return loading.from_dict({"launch": launch, "worker": {"model": "debug", "async_ckpt": True}})


def test_hydra_command(tmp_path):
    c = cfg(launcher="mpiexec", ranks_per_node=12, args=["--cpu-bind", "depth"])
    plan = launcher_for("mpiexec").plan(c, ["x1", "x2"], "/bin/mpiexec", "hydra", {"A": "1"},
                                        tmp_path / "hosts")  # fmt: skip
    (proc,) = plan.procs
    assert proc.argv[:9] == ["/bin/mpiexec", "-n", "24", "-ppn", "12", "-f",
                             str(tmp_path / "hosts"), "-genvall", "-prepend-rank"]  # fmt: skip
    assert proc.argv[9:11] == ["--cpu-bind", "depth"]
    assert proc.argv[11:] == [sys.executable, "-m", "worker.train", "--model", "debug",
                              "--async-ckpt"]  # fmt: skip
    assert proc.env == {"A": "1"} and plan.world == 24 and plan.stop_signal.name == "SIGUSR1"


def test_pals_and_srun_commands(tmp_path):
    c = cfg(launcher="mpiexec", ranks_per_node=2)
    plan = launcher_for("mpiexec").plan(c, ["a", "b"], "mpiexec", "pals", {}, tmp_path / "h")
    argv = plan.procs[0].argv
    assert argv[:10] == ["mpiexec", "-n", "4", "--ppn", "2", "--hostfile", str(tmp_path / "h"),
                         "--envall", "--label", sys.executable]  # fmt: skip
    c = cfg(launcher="srun", ranks_per_node=4)
    argv = launcher_for("srun").plan(c, ["a", "b"], "srun", "srun", {}).procs[0].argv
    assert argv[:5] == ["srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--nodelist=a,b"]
    assert "--overlap" in argv  # the standby's, templates' and checks' steps share the CPUs


def test_srun_ranks_get_the_rendezvous_on_rank_0s_host():
    """Under srun no MPI agrees on one: the plan carries rank 0's host and the port drawn."""
    srun = launcher_for("srun")
    assert not srun.ranks_agree_rendezvous and launcher_for("mpiexec").ranks_agree_rendezvous
    env = srun.plan(cfg(launcher="srun"), ["a", "b"], "srun", "srun", {"X": "1"},
                    master_port=23456).procs[0].env  # fmt: skip
    assert env == {"X": "1", "MASTER_ADDR": "a", "MASTER_PORT": "23456"}
    here = srun.plan(cfg(launcher="srun"), [hosts.this_host()], "srun", "srun", {},
                     master_port=2).procs[0].env  # fmt: skip
    assert here["MASTER_ADDR"] == "127.0.0.1"
    assert srun.node_launches("srun") is None  # a step on one node: templates, prepared ranks


def test_local_plan_sets_torchrun_variables(tmp_path):
    local = launcher_for("local")
    plan = local.plan(cfg(ranks_per_node=2), ["h"], "", "local", {"ES_ATTEMPT": "0"},
                      master_port=1234)  # fmt: skip
    assert len(plan.procs) == 2
    env = plan.procs[1].env
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["OMP_NUM_THREADS"] == "1" and env["ES_ATTEMPT"] == "0"
    text = local.plan(cfg(ranks_per_node=1), ["h"], "", "local",
                      {"ES_HEARTBEAT_KEY": "abc"}).text()  # fmt: skip
    assert "abc" not in text and "ES_HEARTBEAT_KEY='<secret>'" in text


def test_nodes_from_pbs_nodefile_and_lists(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1\nx1\nx2\nx2\n")
    mpiexec = launcher_for("mpiexec")
    launch = cfg(launcher="mpiexec").launch
    assert mpiexec.nodes(launch, {"PBS_NODEFILE": str(nodefile)}, "f") == ["x1", "x2"]
    assert mpiexec.nodes(launch, {"SLURM_JOB_NODELIST": "n1,n2"}, "f") == ["n1", "n2"]
    assert mpiexec.nodes(launch, {}, "f") == [hosts.this_host()]
    launch = cfg(launcher="mpiexec", nodes=["a", "b"]).launch
    assert mpiexec.nodes(launch, {"PBS_NODEFILE": str(nodefile)}, "f") == ["a", "b"]
    launch = cfg(launcher="mpiexec", hostfile=str(tmp_path / "missing")).launch
    with pytest.raises(C.ConfigError, match="cannot read host file"):
        mpiexec.nodes(launch, {}, "f")
    launch = cfg(launcher="local", nodes=["elsewhere"]).launch
    with pytest.raises(C.ConfigError, match="this host only"):
        launcher_for("local").nodes(launch, {}, "f")


def test_missing_launcher_is_a_config_error():
    c = cfg(launcher="srun", executable="no-such-srun")
    with pytest.raises(LauncherMissing, match="'no-such-srun' not found"):
        launcher_for("srun").executable(c)


def test_hydra_chunk_prefixes_make_whole_lines():
    h = HydraLines(world=2)
    assert h.feed(b"[1] abc[1] def\n") == [b"[1] abcdef\n"]
    assert h.feed(b"[1] Zero[0] Zero[1] : one\n") == [b"[1] Zero: one\n"]
    assert h.feed(b"[1] Div[0] : zero\n") == [b"[0] Zero: zero\n"]
    assert h.feed(b"[0] a list [5] item\n") == [b"[0] a list [5] item\n"]  # no rank 5
    assert h.feed(b"hydra's own [0] words\n") == [b"hydra's own [0] words\n"]
    assert h.flush() == [b"[1] Div\n"]  # ended without its newline


def test_the_registry_holds_every_kind_a_config_may_name():
    assert set(KINDS) == set(typing.get_args(typing.get_type_hints(C.LaunchConfig)["launcher"]))
    assert launcher_for("local").this_host_only and not launcher_for("srun").this_host_only
    with pytest.raises(ValueError, match="unknown launcher kind 'ssh'; known: mpiexec, srun"):
        launcher_for("ssh")


def test_srun_needs_an_allocation_and_only_its_nodes():
    """Outside one, srun would make an allocation of its own at every launch; a node outside
    it would fail as unreachable, attempt after attempt."""
    srun = launcher_for("srun")
    auto = cfg(launcher="srun").launch
    with pytest.raises(C.ConfigError, match="srun runs inside a Slurm allocation"):
        srun.nodes(auto, {}, "job.toml")
    inside = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a,b"}
    assert srun.nodes(auto, inside, "job.toml") == ["a", "b"]
    listed = cfg(launcher="srun", nodes=["a", "c"]).launch
    with pytest.raises(C.ConfigError, match=r"c not in the allocation \(SLURM_JOB_NODELIST=a,b\)"):
        srun.nodes(listed, inside, "job.toml")
