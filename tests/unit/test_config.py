"""Config loading: defaults, overrides, worker flags, the resolved dump, and every user error."""

from __future__ import annotations

import tomllib

import pytest

from supervisor.commands import cli
from supervisor.settings import config as C
from supervisor.settings import loading, toml_dump
from tests.support import REPO
from tests.support import write_job_toml as write


def test_defaults_and_worker_flags(tmp_path):
    cfg = loading.load(
        write(
            tmp_path,
            """
[worker]
model = "debug"
save_interval = 100
async_ckpt = true
no_resume = false
save_on_exit = false
lr = 0.001
""",
        )
    )
    assert cfg.launch.launcher == "local" and cfg.restart.max_restarts == 10
    assert cfg.worker.module == "worker.train"
    assert cfg.worker_flags() == [
        "--model", "debug", "--save-interval", "100", "--async-ckpt",
        "--no-save-on-exit", "--lr", "0.001",
    ]  # fmt: skip


def test_overrides_parse_toml_values_or_strings(tmp_path):
    path = write(tmp_path, "[worker]\ntrain_iters = 10\n")
    cfg = loading.load(
        path,
        [
            "worker.train_iters=50",
            "job.run_dir=/tmp/some where",
            "restart.backoff_s=[0, 2]",
            "heartbeat.progress.train=30",
        ],
    )
    assert cfg.worker.flags["train_iters"] == 50
    assert cfg.job.run_dir == "/tmp/some where"
    assert cfg.restart.backoff_s == [0.0, 2.0]
    assert cfg.heartbeat.progress.train == 30.0


def test_dump_round_trips():
    cfg = loading.from_dict(
        {
            "job": {"name": "x"},
            "launch": {"env": {"A": "1"}, "args": ["--cpu-bind", "depth"], "nodes": ["h1", "h2"]},
            "worker": {"model": "debug", "async_ckpt": True},
        }
    )
    data = toml_dump.to_dict(cfg)
    assert tomllib.loads(toml_dump.dumps(data)) == data


def test_shipped_configs_validate():
    for name in ("debug.toml", "agpt2b.toml", "agpt20b.toml"):
        cfg = loading.load(REPO / "configs" / name)
        assert cfg.worker.module == "worker.train"


BAD = [
    ("[job]\nnmae = 'x'\n", "job.nmae", "did you mean 'name'"),
    ("[launch]\nlauncher = 'ssh'\n", "launch.launcher", "expected one of"),
    ("[launch]\nranks_per_node = 0\n", "launch.ranks_per_node", ">= 1"),
    ("[launch]\nranks_per_node = '2'\n", "launch.ranks_per_node", "expected an integer"),
    ("[launch]\nnodes = 'some'\n", "launch.nodes", '"auto" or a list'),
    ("[launch]\nnodes = []\n", "launch.nodes", "at least one"),
    ("[restart]\nmax_restarts = -1\n", "restart.max_restarts", ">= 0"),
    ("[restart]\nbackoff_s = [1, -2]\n", "restart.backoff_s[1]", ">= 0"),
    ("[restart]\nmax_same_resume = 1\n", "restart.max_same_resume", ">= 2"),
    ("[heartbeat]\ntimeout_s = 1.0\n", "heartbeat.timeout_s", "at least twice"),
    ("[heartbeat]\ninterval_s = true\n", "heartbeat.interval_s", "expected a number"),
    ("[heartbeat.progress]\ntrain = 0.5\n", "heartbeat.progress.train", "> interval_s"),
    ("[heartbeat.progress]\nfoo = 1\n", "heartbeat.progress.foo", "unknown key"),
    ("[worker]\nsave_interval = {a = 1}\n", "worker.save_interval", "expected a string"),
    ("[worker]\n'Bad-Name' = 1\n", "worker.Bad-Name", "snake_case"),
    ("[[faults]]\nat_s = [10]\n", "faults[0].action", "missing"),
    ("[nope]\nx = 1\n", "nope", "unknown key"),
    ("launch = 3\n", "launch", "expected a table"),
    ("[job\n", "", "not valid TOML"),
]


@pytest.mark.parametrize("text,key,fragment", BAD)
def test_bad_configs_name_file_key_and_expectation(tmp_path, capsys, text, key, fragment):
    path = write(tmp_path, text)
    with pytest.raises(C.ConfigError) as err:
        loading.load(path)
    assert err.value.key == key
    assert fragment in str(err.value)
    for command in ("validate", "run"):
        assert cli.main([command, str(path)]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"error: {path}: {key}")
        assert fragment in line and "\n" not in line


def test_missing_file_and_bad_set(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path / "none.toml")]) == 2
    assert "no such file" in capsys.readouterr().err
    path = write(tmp_path, "[job]\n")
    assert cli.main(["validate", str(path), "--set", "novalue"]) == 2
    assert "expected key.sub=value" in capsys.readouterr().err
