"""Which worker module has a spec (`supervisor.settings.worker_spec.load`), and what a spec
answers: refusals as strings, never the worker's exceptions."""

from __future__ import annotations

import socket
import sys

import pytest

from contracts.config_table import ConfigError
from supervisor.commands import preflight
from supervisor.launch.resolve import Resolved
from supervisor.settings import loading, worker_spec


def test_the_default_module_speaks_through_its_package_spec():
    spec = worker_spec.load("worker.train")
    assert spec is not None and spec is sys.modules["worker.spec"]


@pytest.mark.parametrize("module", ["my.trainer", "fake_rank", "worker.other", "json.decoder"])
def test_a_module_without_a_spec_that_names_it_has_none(module):
    assert worker_spec.load(module) is None


def test_a_spec_returns_the_workers_refusal_as_text():
    spec = worker_spec.load("worker.train")
    assert spec.flags_problem(["--tp", "2"]) is None
    assert spec.flags_problem(["--batch-sise", "2"]).startswith("unrecognized arguments")
    assert spec.run_problem(["--tp", "4"], 6) == (
        "world size 6 is not divisible by --tp 4 x --replicate 1 = 4; choose sizes whose "
        "product divides 6"
    )
    assert spec.flag_kinds()["async_ckpt"] and not spec.flag_kinds()["batch_size"]
    assert spec.flag_kinds()["save_on_exit"]  # --save-on-exit / --no-save-on-exit


def _package(root, name: str, init: str, spec: str | None = None) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(init)
    if spec is not None:
        (root / name / "spec.py").write_text(spec)


def test_finding_no_spec_runs_none_of_the_packages_code(tmp_path, monkeypatch):
    """A `worker.module` whose package has no `spec` costs `validate` nothing: its `__init__`
    (which may import torch, or fail, or act) never runs in the supervisor."""
    marker = tmp_path / "ran"
    _package(tmp_path, "acting", f"open({str(marker)!r}, 'w').close()\n")
    _package(tmp_path, "failing", "raise RuntimeError('boom')\n")
    (tmp_path / "acting" / "sub").mkdir()
    (tmp_path / "acting" / "sub" / "__init__.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("acting.train", "failing.train", "acting.sub.train", "os.path.x"):
        assert worker_spec.load(module) is None
    assert not marker.exists() and "acting" not in sys.modules and "failing" not in sys.modules


def test_a_spec_that_fails_to_import_is_one_line_naming_worker_module(tmp_path, monkeypatch):
    _package(tmp_path, "brokenspec", "", spec="raise RuntimeError('boom in spec')\n")
    _package(
        tmp_path, "halfspec", "", spec="MODULES = ('halfspec.train',)\ndef flag_kinds(): ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(worker_spec.SpecError, match="brokenspec.spec .* RuntimeError: boom in"):
        worker_spec.load("brokenspec.train")
    with pytest.raises(worker_spec.SpecError, match="lacks flags_problem, run_problem, plan_shr"):
        worker_spec.load("halfspec.train")
    text = '[launch]\nlauncher = "local"\n[worker]\nmodule = "brokenspec.train"\n'
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nrun_dir = "{tmp_path}/runs"\n' + text)
    with pytest.raises(ConfigError, match="worker.module: brokenspec.spec"):
        loading.load(path, [])


SPEC = """MODULES = ('{package}.train',)
{standby}
def flag_kinds(): return {{}}
def flags_problem(argv): return None
def run_problem(argv, world): return None
def plan_shrink(argv, world, new_world): raise NotImplementedError
"""


def _resolved(tmp_path, module: str, standby: bool = True) -> Resolved:
    cfg = loading.from_dict({
        "job": {"run_dir": str(tmp_path / "run")},
        "worker": {"module": module},
        "restart": {"standby": standby},
    })  # fmt: skip
    return Resolved(cfg, tmp_path / "run", [socket.gethostname()], sys.executable, "local")


def test_the_standby_is_kept_only_for_a_module_its_spec_declares(tmp_path, monkeypatch):
    """A standby's ranks are the worker started with ES_STANDBY=1: one that does not declare it
    (STANDBY_MODULES) would train beside the job, so the job keeps none, and says so once."""
    _package(tmp_path, "declares", "", spec=SPEC.format(
        package="declares", standby="STANDBY_MODULES = ('declares.train',)"))  # fmt: skip
    _package(tmp_path, "silent", "", spec=SPEC.format(package="silent", standby=""))
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("worker.train", "declares.train"):
        assert _resolved(tmp_path, module).standby_off is None, module
        assert preflight.standby_note(_resolved(tmp_path, module)) is None
    for module in ("silent.train", "my_train", "worker.other"):
        resolved = _resolved(tmp_path, module)
        assert resolved.standby_off == (
            f"worker.module {module!r} does not declare standby support (STANDBY_MODULES in its "
            "package's spec)"
        )
        assert preflight.standby_note(resolved) == (
            f"restart.standby is off: {resolved.standby_off}, so every relaunch starts cold"
        )
        unasked = _resolved(tmp_path, module, standby=False)  # off as asked: nothing to say
        assert unasked.standby_off == "restart.standby is false"
        assert preflight.standby_note(unasked) is None
