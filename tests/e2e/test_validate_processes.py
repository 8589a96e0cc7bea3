"""`validate` and `run --dry-run` on configs whose launcher is mpiexec: they run `mpiexec --version`
(and the torch check runs a python), so they are here, not in unit/test_validate.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.commands import cli
from tests.support import REPO, validate

DEMO = REPO / "configs" / "debug.toml"


@pytest.fixture(autouse=True)
def launcher_on_path(monkeypatch):
    """The demo's launcher (mpiexec) comes with the mpich wheel, beside this python."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize(
    "setting, message",
    [
        ("worker.save_intervl=3", "worker.save_intervl: the worker has no flag --save-intervl; "
         "did you mean save_interval (--save-interval)?"),
        ('worker.model="agpt-3b"', "worker.model: --model: unknown model preset 'agpt-3b'"),
        ("worker.save_interval=-1", "worker.save_interval: --save-interval must be 0 (off)"),
        ("worker.n_kv_heads=0", "worker.n_kv_heads: --n-kv-heads must be at least 1, got 0"),
        ("worker.lr=-1.0", "worker.lr: --lr must be a number >= 0, got -1.0"),
        ("worker.seq_len=0", "worker.seq_len: --seq-len must be at least 1"),
        ("worker.dim=-64", "worker.dim: --dim must be at least 1"),
        ("worker.n_heads=3", "worker.dim: --dim 64 must divide by --n-heads 3"),
        ("worker.tp=3", "worker.tp: world size 2 is not divisible by --tp 3"),
        ("worker.async_ckpt=3", "worker.async_ckpt: --async-ckpt is a switch"),
        ("worker.train_iters=false", "worker.train_iters: --train-iters takes a value"),
        ('worker.device="tpu"', "worker.device: argument --device: invalid choice: 'tpu'"),
    ],
)  # fmt: skip
def test_bad_worker_flags_exit_2_before_launch(capsys, setting, message):
    for command in (["validate"], ["run", "--dry-run"]):
        rc = cli.main([*command, str(DEMO), "--set", setting])
        out = capsys.readouterr()
        assert rc == 2, out
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
        assert lines[0].startswith(f"error: {DEMO}: ")
        assert "Traceback" not in out.err and out.out == ""


def test_a_custom_worker_module_is_checked_as_far_as_it_can_be(capsys):
    rc, out = validate(capsys, str(DEMO), "--set", 'worker.module="my.trainer"')
    assert rc == 0
    assert "is not worker.train: its flags are passed as given" in out
    rc, out = validate(capsys, str(DEMO), "--set", 'worker.module="my.trainer"', "--set",
                       "worker.Bad-Key=1")  # fmt: skip
    assert rc == 2 and "snake_case" in out


def test_the_check_imports_no_torch():
    code = (
        "import sys; from supervisor.commands import cli; "
        f"rc = cli.main(['validate', {str(DEMO)!r}]); "
        "assert rc == 0, rc; "
        "assert not [m for m in sys.modules if m.split('.')[0] == 'torch'], 'torch imported'"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_a_host_that_does_not_resolve_is_refused_before_launch(capsys, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for command in (["validate"], ["run", "--dry-run"], ["run"]):
        rc = cli.main([*command, str(DEMO), "--set", 'launch.nodes=["no-such-host-xyz.invalid"]'])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert "launch.nodes: host 'no-such-host-xyz.invalid' does not resolve" in err
