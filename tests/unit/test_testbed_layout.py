"""The test bed's pure parts (`testbed/layout.py`, `testbed/run_dir.py`): the plan of a bed, the
/etc/hosts block that `up` adds and `down` removes with every other line kept, the run dir's
files; and that the bed uses only the standard library. No namespace, no root."""

from __future__ import annotations

import ast
import sys

import pytest

from testbed import run_dir
from testbed.layout import (
    BLOCK_BEGIN,
    BLOCK_END,
    enter_argv,
    host_hosts_file,
    plan,
    with_block,
    without_block,
)
from tests.support import REPO


def test_a_plan_names_and_numbers_the_hosts():
    bed = plan(3, "vm")
    assert bed.names() == ["n0", "n1", "n2"]
    assert [h.address for h in bed.hosts] == ["10.233.0.10", "10.233.0.11", "10.233.0.12"]
    assert bed.host("10.233.0.11").name == "n1" and bed.host("n2").netns == "estb-n2"
    assert all(len(h.veth) <= 15 for h in plan(200, "vm").hosts)  # the kernel's name limit
    with pytest.raises(KeyError):
        bed.host("n3")
    with pytest.raises(ValueError):
        plan(0, "vm")


def test_inside_a_host_the_machine_is_at_the_bridge():
    text = host_hosts_file(plan(2, "vm"))
    assert "10.233.0.1 vm\n" in text and "10.233.0.10 n0\n" in text and "10.233.0.11 n1\n" in text


@pytest.mark.parametrize(
    "before",
    ["", "127.0.0.1 localhost\n", "127.0.0.1 localhost\n::1 x", "a\r\nb\r\n# not ours\n"],
)
def test_the_block_goes_as_it_came_and_keeps_every_other_line(before):
    bed = plan(2, "vm")
    added = with_block(before, bed)
    assert added.count(BLOCK_BEGIN) == 1 and "10.233.0.11 n1\n" in added
    assert with_block(added, bed) == added  # up twice: one block
    assert without_block(added).rstrip("\n") == before.rstrip("\n")
    assert without_block(before) == before
    after = without_block(added + "192.0.2.9 later\n")  # a line added after the block stays
    assert after.endswith("192.0.2.9 later\n") and BLOCK_END not in after


def test_a_command_enters_every_namespace_of_the_host_in_the_callers_directory():
    argv = enter_argv(42, ["hostname"], "/work")
    assert argv[:3] == ["nsenter", "-t", "42"]
    assert {"--net", "--mount", "--uts", "--ipc", "--pid"} <= set(argv[: argv.index("--")])
    assert argv[-2:] == ["/work", "hostname"]


def test_the_run_dir_says_what_was_written(tmp_path):
    bed = plan(2, "vm")
    run_dir.create(bed, host_hosts_file(bed), tmp_path)
    assert run_dir.read_plan(tmp_path) == bed
    assert (tmp_path / "hosts" / "10.233.0.11" / "state").parent.resolve().name == "n1"
    assert run_dir.read_host("n0", tmp_path).state == "killed"  # nothing said yet: not up
    run_dir.write_host(run_dir.HostRecord("n0", "up", 7, 8, 9), tmp_path)
    run_dir.set_state("n0", "cut", tmp_path)
    assert run_dir.read_host("n0", tmp_path) == run_dir.HostRecord("n0", "cut", 7, 8, 9)
    assert run_dir.read_plan(tmp_path / "nothing") is None


def test_the_bed_uses_only_the_standard_library():
    allowed = {*sys.stdlib_module_names, "testbed", "__future__"}
    bad = []
    for path in (REPO / "testbed").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] not in allowed]
    assert not bad, bad


def test_the_slurm_conf_makes_each_host_a_node_at_its_address():
    from testbed import slurm

    text = slurm.conf_text(plan(3, "vm"), cpus=2)
    assert "SlurmctldHost=vm(10.233.0.1)" in text
    assert "NodeName=n1 NodeAddr=10.233.0.11 NodeHostname=n1" in text
    assert "PartitionName=bed Nodes=n0,n1,n2 Default=YES" in text
    assert "ProctrackType=proctrack/linuxproc" in text and "TaskPlugin=task/none" in text
    # everything it writes lies under the bed's run dir, which `down` removes
    paths = [v for line in text.splitlines() if "=" in line for v in [line.split("=", 1)[1]]
             if v.startswith("/")]  # fmt: skip
    assert paths and all(p.startswith(str(slurm.SLURM_DIR)) for p in paths), paths
    assert slurm.usable("IDLE") and slurm.usable("MIXED") and not slurm.usable("DOWN+DRAIN")
    assert not slurm.usable("IDLE+NOT_RESPONDING") and not slurm.usable("IDLE+DRAIN")
