"""A new user's mistakes in a config: each one ends `validate` (and `run`) in one line that
names the key and the fix, exit 2, and the first real mistake is the one named (issues 24, 25).
Process-free: every config here uses the local launcher or a launcher found by name only."""

from __future__ import annotations

import pytest

from supervisor.commands import cli
from supervisor.settings import checks, loading, toml_dump
from tests.support import REPO, one_line_error, validate
from tests.support import write_job_toml as write

DEBUG = REPO / "configs" / "debug.toml"
LOCAL = '[launch]\nlauncher = "local"\n'


def demo_with(tmp_path, old: str, new: str):
    """configs/debug.toml with one line changed, on the local launcher (no mpiexec started)."""
    text = DEBUG.read_text()
    assert old in text
    text = text.replace(old, new).replace('launcher = "mpiexec"', 'launcher = "local"')
    return write(tmp_path, text.replace('run_dir = "runs/', f'run_dir = "{tmp_path}/runs/'))


def test_a_worker_key_typo_is_named_before_the_faults_that_depend_on_it(tmp_path, capsys):
    path = demo_with(tmp_path, "save_interval = 10", "save_intervl = 10")
    err = one_line_error(capsys, ["validate", str(path)])
    assert "worker.save_intervl: the worker has no flag --save-intervl" in err
    assert "did you mean save_interval (--save-interval)?" in err
    assert "after_checkpoint" not in err


def test_a_worker_value_the_worker_refuses_is_named_before_the_faults(tmp_path, capsys):
    path = demo_with(tmp_path, "save_interval = 10", "save_interval = -10")
    err = one_line_error(capsys, ["validate", str(path)])
    assert "worker.save_interval: --save-interval must be 0 (off) or positive, got -10" in err


@pytest.mark.parametrize(
    "old, new, key, hint",
    [
        ("[worker]", "[wroker]", "wroker", "did you mean 'worker'?"),
        ("[[faults]]", "[[fault]]", "fault", "did you mean 'faults'?"),
    ],
)
def test_misspelt_tables_get_a_suggestion_and_the_known_list(tmp_path, capsys, old, new, key, hint):
    path = demo_with(tmp_path, old, new)
    err = one_line_error(capsys, ["validate", str(path)])
    assert f"{path}: {key}: unknown key ({hint})" in err
    assert "known: job, launch, worker, restart, heartbeat, stragglers, guard, faults" in err


def test_the_set_examples_of_help_work_on_the_demo_as_printed(tmp_path, capsys):
    path = demo_with(tmp_path, 'name = "debug"', 'name = "debug"')
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--set 'faults=[]' --set worker.train_iters=50" in " ".join(help_text.split())
    rc, out = validate(capsys, str(path), "--set", "faults=[]", "--set", "worker.train_iters=50")
    assert rc == 0, out
    cfg = loading.load(path, ["faults=[]", "worker.train_iters=50"])
    assert cfg.faults == [] and cfg.worker.flags["train_iters"] == 50
    assert "faults" not in toml_dump.to_dict(cfg)  # the resolved dump has none either


def test_a_set_that_leaves_a_fault_out_of_reach_says_how_to_drop_the_faults(tmp_path, capsys):
    path = demo_with(tmp_path, 'name = "debug"', 'name = "debug"')
    err = one_line_error(capsys, ["validate", str(path), "--set", "worker.train_iters=50"])
    assert "faults[0].at_step: step 80 is never reached" in err
    assert "--set 'faults=[]'" in err


def test_a_job_config_with_an_experiment_table_points_to_experiment(tmp_path, capsys):
    path = write(tmp_path, LOCAL + '[experiment]\nname = "x"\n')
    err = one_line_error(capsys, ["run", str(path)])
    assert "python -m supervisor experiment CONFIG" in err


# --- issue 25: values that passed validate and failed at run ------------------------------------
NAMES = ["a/b", "..", "a..b", "../x", "-x", ".hidden", "a b", "x" * 65, "é", "a\\tb"]


@pytest.mark.parametrize("name", NAMES)
def test_job_names_are_names(tmp_path, capsys, name):
    path = write(tmp_path, f'[job]\nname = "{name}"\n' + LOCAL)
    err = one_line_error(capsys, ["validate", str(path)])
    assert f"{path}: job.name: expected " in err
    assert 'ASCII letters, digits, ".", "_" and "-"' in err or "at most 64" in err


@pytest.mark.parametrize("name", ["debug", "agpt2b-restart", "a.b_c-1", "X" * 64])
def test_plain_names_pass(name):
    assert checks.name_problem(name) is None


BAD_RUN_VALUES = [
    # (config text, key, fragment of the message)
    ('[launch]\nlauncher = "mpiexec"\nflavor = "hydra"\nnodes = ["n0", "n1", "n0"]\n',
     "launch.nodes", "'n0' named more than once"),
    ('[launch]\nlauncher = "mpiexec"\nflavor = "hydra"\nnodes = ["vm", "vm"]\n',
     "launch.nodes", "'vm' named more than once"),
    ('[launch]\nlauncher = "mpiexec"\nflavor = "hydra"\nnodes = ["n0", "n1:4"]\n',
     "launch.nodes[1]", "expected a host name"),
    ('[launch]\nlauncher = "mpiexec"\nflavor = "hydra"\nnodes = ["n0,n1"]\n',
     "launch.nodes[0]", "expected a host name"),
    (LOCAL + 'env = { "A=B" = "x" }\n', "launch.env.A=B", "not an environment variable name"),
    (LOCAL + 'env = { "" = "x" }\n', "launch.env.", "not an environment variable name"),
    (LOCAL + 'env = { "1A" = "x" }\n', "launch.env.1A", "not an environment variable name"),
    (LOCAL + 'env = { A = "x\\u0000y" }\n', "launch.env.A", "NUL byte"),
    (LOCAL + '[worker]\ndata_path = "a\\u0000b"\n', "worker.data_path", "NUL byte"),
    ('[job]\nrun_dir = "/tmp/x\\u0000"\n' + LOCAL, "job.run_dir", "NUL byte"),
    ('[launch]\nlauncher = "mpiexec"\nflavor = "hydra"\nargs = ["-n", ""]\n',
     "launch.args[1]", "empty string"),
    (LOCAL + "ranks_per_node = 100000\n", "launch.ranks_per_node", "at most 4096"),
    (LOCAL + "[heartbeat]\ninterval_s = 1e-9\ntimeout_s = 1.0\n", "heartbeat.interval_s",
     "seconds >= 0.01"),
    (LOCAL + '[heartbeat]\nbind = ""\n', "heartbeat.bind", "got an empty string"),
    (LOCAL + '[heartbeat]\nadvertise = " "\n', "heartbeat.advertise", "got an empty string"),
    (LOCAL + '[worker]\nsave_interval = 10\ntrain_iters = 0\n', "worker.train_iters",
     "--train-iters must be at least 1"),
]  # fmt: skip


@pytest.mark.parametrize("text, key, fragment", BAD_RUN_VALUES)
def test_values_that_would_fail_at_run_are_refused_at_validate(tmp_path, capsys, text, key,
                                                               fragment):  # fmt: skip
    path = write(tmp_path, text)
    for command in (["validate"], ["run", "--dry-run"]):
        err = one_line_error(capsys, [*command, str(path)])
        assert err.startswith(f"error: {path}: {key}: "), err
        assert fragment in err


def paths_config(tmp_path, launch: str = "", worker: str = "", job: str = "") -> str:
    run = tmp_path / "run"
    return f'[job]\nrun_dir = "{run}"\n{job}' + LOCAL + launch + "[worker]\n" + worker


@pytest.mark.parametrize(
    "launch, worker, key, fragment",
    [
        ('cwd = "{f}"\n', "", "launch.cwd", "not a directory"),
        ('cwd = "{d}/none"\n', "", "launch.cwd", "no such directory"),
        ('python = "{d}/none/python"\n', "", "launch.python", "no such executable file"),
        ('python = "{d}"\n', "", "launch.python", "no such executable file"),
        ("", 'ckpt_dir = "{f}"\n', "worker.ckpt_dir", "is a file, not a directory"),
        ("", 'ckpt_dir = "{f}/ckpt"\n', "worker.ckpt_dir", "is not a directory"),
        ("", 'async_ckpt = true\nckpt_stage_dir = "{f}/s"\n', "worker.ckpt_stage_dir",
         "is not a directory"),
        ("", 'data_path = "{d}/tokens.bin"\n', "worker.data_path", "no such file"),
    ],
)  # fmt: skip
def test_paths_that_cannot_work_on_this_host(tmp_path, capsys, launch, worker, key, fragment):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    fill = {"f": a_file, "d": tmp_path}
    path = write(tmp_path, paths_config(tmp_path, launch.format(**fill), worker.format(**fill)))
    err = one_line_error(capsys, ["validate", str(path)])
    assert err.startswith(f"error: {path}: {key}: ") and fragment in err, err


def test_a_run_dir_below_a_file(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    text = f'[job]\nrun_dir = "{tmp_path}/a-file/run"\n' + LOCAL
    err = one_line_error(capsys, ["validate", str(write(tmp_path, text))])
    assert f"job.run_dir: {tmp_path}/a-file/run: {tmp_path}/a-file is not a directory" in err


def test_a_heartbeat_address_this_host_cannot_listen_on(tmp_path, capsys):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        text = LOCAL + f'[heartbeat]\nbind = "127.0.0.1"\nport = {port}\n'
        err = one_line_error(capsys, ["validate", str(write(tmp_path, text))])
        assert "heartbeat.port: cannot listen on 127.0.0.1:" in err
        assert "Address already in use" in err
    finally:
        taken.close()
    text = LOCAL + '[heartbeat]\nbind = "no-such-interface"\n'
    err = one_line_error(capsys, ["validate", str(write(tmp_path, text))])
    assert "heartbeat.bind: cannot listen on no-such-interface:*" in err


def test_nul_problem_names_the_first_key():
    assert checks.nul_problem({"a": {"b": ["x", "y\0"]}}) == "a.b[1]"
    assert checks.nul_problem({"a": {"k\0": 1}}) == "a.k\0"
    assert checks.nul_problem({"a": [1, 2.0, True, "ok"]}) is None


def test_duplicates_in_the_order_they_repeat():
    assert checks.duplicates(["a", "b", "b", "a", "a"]) == ["b", "a"]
    assert checks.duplicates(["a"]) == []


def test_host_names_from_a_host_file_are_checked_as_a_list_is(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("n0\nbad/host\n")
    text = f'[launch]\nlauncher = "mpiexec"\nflavor = "hydra"\nhostfile = "{hosts}"\n'
    err = one_line_error(capsys, ["validate", str(write(tmp_path, text))])
    assert "launch.hostfile: expected a host name" in err and f"'bad/host' (from {hosts})" in err


def test_a_worker_module_is_a_module_name(tmp_path, capsys):
    err = one_line_error(
        capsys, ["validate", str(write(tmp_path, LOCAL + '[worker]\nmodule = "os; rm"\n'))]
    )
    assert "worker.module: expected a Python module name (`python -m NAME`), got 'os; rm'" in err
