"""Host lists a user writes: a host file with a comment line, a line with no host before ":" or
bytes that are not text each ended `validate` in a traceback (IndexError, UnicodeDecodeError);
two names of one host that differ in case ("vm", "VM") passed as two nodes. Process-free."""

from __future__ import annotations

import pytest

from supervisor.commands import cli
from supervisor.launch import hosts
from tests.support import write_job_toml as write

MPI = '[launch]\nlauncher = "mpiexec"\nflavor = "hydra"\n'


def run_validate(capsys, path) -> tuple[int, str]:
    rc = cli.main(["validate", str(path)])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"n1\n:4\n", "line 2: no host name in ':4'"),
        (b"n1\n\xff\xfe\n", "is not UTF-8 text"),
    ],
)
def test_a_damaged_host_file_is_one_line(tmp_path, capsys, content, fragment):
    hosts = tmp_path / "hosts"
    hosts.write_bytes(content)
    path = write(tmp_path, f'[job]\nrun_dir = "{tmp_path}/r"\n{MPI}hostfile = "{hosts}"\n')
    rc, err = run_validate(capsys, path)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"launch.hostfile: host file {hosts}" in err and fragment in err, err


def test_a_host_file_with_comments_and_slots_is_read(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the nodes\nn1:2\n\n   # indented comment\nn2 slots=2\nn1\n")
    assert hosts.read_hostfile(hostfile, "job.toml", "launch.hostfile") == ["n1", "n2"]


def test_one_host_named_twice_in_different_case_is_refused(tmp_path, capsys):
    path = write(tmp_path, f'[job]\nrun_dir = "{tmp_path}/r"\n{MPI}nodes = ["n1", "N1"]\n')
    rc, err = run_validate(capsys, path)
    assert rc == 2 and err.count("\n") == 1, err
    assert "launch.nodes: 'n1' named more than once" in err, err
