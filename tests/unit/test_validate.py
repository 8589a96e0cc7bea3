"""Bad input caught before anything launches: unreadable config files. The `[worker]` keys and
values checked against the worker's own parser are in e2e/test_validate_processes.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts import env_names
from supervisor.commands import cli
from supervisor.settings import loading
from tests.support import validate


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x00\x01\x02\xff", "not UTF-8 text at byte 3 (a binary file?)"),
        (b'[job]\nname = "caf\xe9"\n', "not UTF-8 text at byte 17"),
        (b"", "is empty"),
        (b"  \n\n", "is empty"),
        (b"[job]\nname = \x00\n", "not a text file (it holds NUL bytes)"),
        (b"[job\n", "not valid TOML"),
    ],
)
def test_unreadable_configs_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "job.toml"
    path.write_bytes(content)
    for command in (["validate"], ["run"], ["run", "--dry-run"], ["experiment"]):
        rc = cli.main([*command, str(path)])
        out = capsys.readouterr()
        assert rc == 2
        assert out.err.count("\n") == 1 and message in out.err, out.err
        assert "Traceback" not in out.err


def test_a_directory_a_missing_file_and_no_permission(tmp_path, capsys, monkeypatch):
    rc, out = validate(capsys, str(tmp_path))
    assert rc == 2 and out == f"error: {tmp_path}: is a directory, expected a TOML file\n"
    rc, out = validate(capsys, str(tmp_path / "nope.toml"))
    assert rc == 2 and "nope.toml: no such file" in out
    locked = tmp_path / "locked.toml"
    locked.write_text("[job]\n")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # root reads anything: make it fail
    rc, out = validate(capsys, str(locked))
    assert rc == 2 and "locked.toml: permission denied" in out


def test_parse_toml_file_returns_the_tables(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text('[job]\nname = "x"\n')
    assert loading.parse_toml_file(path) == {"job": {"name": "x"}}


def test_a_memory_tier_needs_a_root_that_can_hold_its_directory(tmp_path, capsys, monkeypatch):

    (tmp_path / "file").write_text("")
    config = tmp_path / "job.toml"
    config.write_text(
        f'[job]\nname = "m"\nrun_dir = "{tmp_path / "run"}"\n[launch]\nlauncher = "local"\n'
        "[worker]\nmem_ckpt_interval = 1\n"
    )
    monkeypatch.setenv(env_names.ENV_MEM_ROOT, str(tmp_path / "file" / "shm"))
    rc, out = validate(capsys, str(config))
    assert rc == 2 and "worker.mem_ckpt_interval" in out, out
    assert f"{tmp_path / 'file'} is not a directory" in out and "ES_MEM_ROOT" in out
    monkeypatch.setenv(env_names.ENV_MEM_ROOT, str(tmp_path / "shm"))  # made when held
    rc, out = validate(capsys, str(config))
    assert rc == 0, out
