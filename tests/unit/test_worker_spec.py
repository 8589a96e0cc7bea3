"""Which worker module has a spec (`supervisor.settings.worker_spec.load`), and what a spec
answers: refusals as strings, never the worker's exceptions."""

from __future__ import annotations

import sys

import pytest

from supervisor.settings import worker_spec


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
