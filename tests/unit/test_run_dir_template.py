"""job.run_dir (and experiment.dir) take only plain {name} and {time}: str.format's other
forms reached into the value (`{name.__class__}` passed validate) or padded it to any width
(`{name:>999999999}` built a gigabyte string, then a traceback). A path the kernel cannot take
(a name over NAME_MAX) is one line, not OSError from Path.exists(). Process-free."""

from __future__ import annotations

import pytest

from supervisor.commands import cli
from tests.support import one_line_error
from tests.support import write_job_toml as write

LOCAL = '[launch]\nlauncher = "local"\n'


@pytest.mark.parametrize(
    "template",
    ["{name:>999999999}", "{name.__class__}", "{name!r}", "{name[0]}", "{}", "{0}", "{nme}", "{"],
)
def test_a_placeholder_other_than_plain_name_or_time_is_refused(tmp_path, capsys, template):
    text = f'[job]\nrun_dir = "{tmp_path}/runs/{template}"\n' + LOCAL
    path = write(tmp_path, text)
    err = one_line_error(capsys, ["validate", str(path)])
    assert err.startswith(f"error: {path}: job.run_dir: bad placeholder"), err
    assert "use only {name} and {time}" in err


def test_plain_placeholders_and_doubled_braces_pass(tmp_path, capsys):
    text = f'[job]\nrun_dir = "{tmp_path}/runs/{{{{x}}}}-{{name}}-{{time}}"\n' + LOCAL
    assert cli.main(["validate", str(write(tmp_path, text))]) == 0, capsys.readouterr().err


def test_a_run_dir_name_too_long_for_the_kernel(tmp_path, capsys):
    text = f'[job]\nrun_dir = "{tmp_path}/{"x" * 300}"\n' + LOCAL
    err = one_line_error(capsys, ["validate", str(write(tmp_path, text))])
    assert "job.run_dir: " in err and "File name too long" in err


def test_an_experiment_dir_with_a_format_spec_is_refused(tmp_path, capsys):
    exp = tmp_path / "exp.toml"
    exp.write_text(
        f'[experiment]\nname = "e"\ndir = "{tmp_path}/{{name:>99999999}}"\n'
        'phases = ["baseline"]\n' + LOCAL
    )
    err = one_line_error(capsys, ["validate", str(exp)])
    assert "experiment.dir: bad placeholder" in err, err
