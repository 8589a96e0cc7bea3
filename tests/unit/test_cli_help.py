"""What `--help` and `validate` tell a new user (issue 24): every exit code, each command's own,
the worker's flags with their defaults, experiment configs, and nodes that fall back to this
host. Process-free: the configs here use the local launcher or a flavor given by name."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import pytest

from contracts.exit_codes import ExitCode
from supervisor.commands import cli
from supervisor.launch.resolve import nodes_note
from supervisor.settings import config as C
from tests.support import REPO, validate
from worker import args as worker_args


def subcommand_help(name: str) -> str:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name].format_help()


def codes_listed(text: str) -> set[int]:
    block = text.split("exit status", 1)[1]
    return {int(m) for m in re.findall(r"^  (\d+) ", block, re.MULTILINE)}


def test_help_lists_every_exit_code_of_the_supervisor():
    every = {int(c) for c in ExitCode}
    assert set(cli.EXIT_MEANINGS) == set(ExitCode)  # a new code needs its line
    assert codes_listed(cli.build_parser().format_help()) == every | {cli.INTERRUPTED_BY_USER}
    assert "6   too few nodes" in cli.build_parser().format_help()
    assert codes_listed(subcommand_help("run")) == every
    assert codes_listed(subcommand_help("experiment")) == every


@pytest.mark.parametrize("command", ["validate", "tail", "status", "report"])
def test_each_read_only_command_lists_only_its_own_codes(command):
    listed = codes_listed(subcommand_help(command))
    assert {0, 1, 2} <= listed
    assert not listed & {3, 4, 5, 6}  # budget, progress, a job's stop, nodes: a job's codes


def test_ctrl_c_codes_are_those_listed(monkeypatch):
    def interrupt(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_validate", interrupt)
    monkeypatch.setattr(cli, "cmd_tail", interrupt)
    assert cli.main(["validate", "x.toml"]) == cli.INTERRUPTED_BY_USER
    assert cli.main(["tail", "x"]) == ExitCode.DONE  # the way to stop --follow


def test_every_worker_flag_has_help_and_shows_its_default():
    parser = worker_args.build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[-1]
        assert action.help, f"{flag} has no help"
        if action.default is not None and action.default is not False:
            shown = f"(default: {action.default})"
            assert shown in text, f"{flag}: {shown} not in --help"
    assert "without it nothing is saved" in text  # --ckpt-dir
    assert "--lr LR peak learning rate (AdamW) (default: 0.003)" in text
    assert "--seed SEED model init and synthetic data (default: 0)" in text


def test_validate_takes_the_shipped_experiment_configs(capsys):
    for name in ("restart.toml", "agpt2b.toml"):
        path = REPO / "configs" / "experiments" / name
        # The local launcher: nothing started to ask mpiexec its flavor.
        rc, out = validate(capsys, str(path), "--set", "launch.launcher=local", "--set",
                           "launch.args=[]")  # fmt: skip
        assert rc == 0, out
        assert f"{path}: ok (experiment " in out and "phases baseline, sync, async" in out


def test_validate_checks_every_phase_of_an_experiment(tmp_path, capsys):
    text = (REPO / "configs" / "experiments" / "restart.toml").read_text()
    text = text.replace('launcher = "mpiexec"', 'launcher = "local"')
    path = tmp_path / "exp.toml"
    for changed, fragment in [
        (text + "\n[experiment.x]\n", "experiment.x: unknown key"),
        (text.replace("# async = [", 'async = ["worker.save_intervl=3"] #'),
         "(async): worker.save_intervl: the worker has no flag --save-intervl"),
        (text.replace('name = "restart"', 'name = "a/b"'),
         "experiment.name: expected ASCII letters"),
        (text.replace('name = "restart"', f'name = "{"x" * 56}"'),
         "experiment.name: expected at most 55 characters"),
    ]:  # fmt: skip
        path.write_text(changed)
        rc, out = validate(capsys, str(path))
        assert rc == 2 and fragment in out and out.count("\n") == 1, out


def test_experiment_dry_run_prints_every_phase_and_starts_nothing(tmp_path, capsys):
    text = (REPO / "configs" / "experiments" / "restart.toml").read_text()
    text = text.replace('launcher = "mpiexec"', 'launcher = "local"')
    text = text.replace('dir = "runs/{name}-{time}"', f'dir = "{tmp_path}/exp"')
    path = tmp_path / "exp.toml"
    path.write_text(text)
    assert cli.main(["experiment", "--dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    for phase in ("baseline", "sync", "async"):
        assert f"# === phase {phase}" in out
        assert f'name = "restart-{phase}"' in out
    assert out.count("# launch command (attempt 0)") == 3
    assert not (tmp_path / "exp").exists()


def test_a_multi_node_config_validated_outside_a_batch_job_says_it_fell_back(capsys, monkeypatch):
    for name in ("PBS_NODEFILE", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    path = REPO / "configs" / "agpt2b.toml"  # 2 nodes in a PBS job; mpiexec found by name
    rc, out = validate(capsys, str(path), "--set", "launch.flavor=auto")  # PATH's: MPICH's
    assert rc == 0, out
    assert 'note: launch.nodes = "auto": no PBS_NODEFILE or SLURM_JOB_NODELIST here' in out


def test_a_flavor_named_is_refused_when_the_mpiexec_found_is_another(tmp_path, capsys, monkeypatch):
    """The shipped PBS configs name PALS; the mpiexec found first on PATH here is the
    environment's MPICH Hydra: validate says so and names `executable`, never runs it as PALS."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    rc, out = validate(capsys, str(REPO / "configs" / "agpt2b.toml"))
    assert rc == 2 and out.count("\n") == 1, out
    assert 'launch.executable: flavor = "pals", but ' in out and "is MPICH Hydra's mpiexec" in out
    pals = tmp_path / "pals-mpiexec"  # a program that says it is PALS, as Cray's does
    pals.write_text("#!/bin/sh\necho 'mpiexec version 1.2.12 (Cray PALS)'\n")
    pals.chmod(0o755)
    rc, out = validate(capsys, str(REPO / "configs" / "agpt2b.toml"), "--set",
                       f'launch.executable="{pals}"', "--set", "launch.flavor=hydra")  # fmt: skip
    assert rc == 2 and f"{pals} is Cray PALS's mpiexec" in out, out


def test_nodes_note_only_when_auto_fell_back():
    auto = C.LaunchConfig(launcher="mpiexec")
    assert "this host only (h)" in str(nodes_note(auto, {}, ["h"]))
    assert nodes_note(auto, {"PBS_NODEFILE": "/x"}, ["a", "b"]) is None
    assert nodes_note(auto, {"SLURM_JOB_NODELIST": "a,b"}, ["a", "b"]) is None
    assert nodes_note(C.LaunchConfig(launcher="mpiexec", nodes=["h"]), {}, ["h"]) is None
    assert nodes_note(C.LaunchConfig(launcher="local"), {}, ["h"]) is None
