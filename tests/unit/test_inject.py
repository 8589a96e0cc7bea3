"""The registry of test-only failure points (`ES_INJECT`): what it reads, what it refuses, and
that the docs name every point."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts import inject
from contracts.env_names import ENV_INJECT
from supervisor.host.node_probe import injected_problems
from tests.support import one_line_error, write_job_toml

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_unset_arms_nothing():
    points = inject.read({})
    assert points == inject.Injection() and not points.arms_the_worker()
    assert inject.parse(" , ") == inject.Injection()


def test_points_read_as_their_kind():
    points = inject.parse(
        "rank=1, raise_at_step=5,kill_in_save_at_step=8,kill_async_phase=after-marker,"
        "ckpt_delay_s=0.25,node_check_fail=n1+n2"
    )
    assert points.rank == 1 and points.raise_at_step == 5 and points.kill_in_save_at_step == 8
    assert points.kill_async_phase == "after-marker" and points.ckpt_delay_s == 0.25
    assert points.node_check_fail == ("n1", "n2")
    assert points.arms_the_worker()
    assert inject.parse("node_check_fail= n1 + n2 ").node_check_fail == ("n1", "n2")
    assert not inject.parse("rank=3,node_check_fail=n0").arms_the_worker()


@pytest.mark.parametrize(
    "text,message",
    [
        ("stall=3", "unknown point 'stall' (known: rank, raise_at_step, "),
        ("raise_at_step", "raise_at_step needs a value"),
        ("rank=1,rank=2", "rank is set twice"),
        ("raise_at_step=-1", "raise_at_step='-1' is not a step (an integer >= 0)"),
        ("ckpt_delay_s=nan", "ckpt_delay_s='nan' is not seconds (a number >= 0)"),
        ("kill_async_phase=middle", "kill_async_phase='middle' is not an async save's phase"),
        ("kill_async_phase=write", "kill_async_phase needs kill_in_save_at_step"),
        ("node_check_fail=n1++n2", "node_check_fail='n1++n2' is not node names"),
        ("node_check_fail=n1 n2", "node_check_fail='n1 n2' is not node names (+-separated)"),
        ("raise_at_step=5;rank=1", "is not a step (an integer >= 0); separate points with ','"),
        ("rank=" + "9" * 5000, "rank='" + "9" * inject.SHOWN_MAX + "'... is not a rank"),
    ],
)
def test_bad_values_are_one_line(text, message):
    with pytest.raises(inject.InjectError) as caught:
        inject.parse(text)
    said = str(caught.value)
    assert said.startswith(f"{ENV_INJECT}: ") and message in said and "\n" not in said


def test_spec_writes_what_parse_reads():
    text = inject.spec(rank=1, kill_in_save_at_step=8, node_check_fail=["a", "b"])
    assert text == "rank=1,kill_in_save_at_step=8,node_check_fail=a+b"
    assert inject.parse(text).node_check_fail == ("a", "b")
    with pytest.raises(inject.InjectError):
        inject.spec(raise_at=3)


def test_the_node_check_fails_the_named_nodes_and_on_a_bad_value():
    env = {ENV_INJECT: "node_check_fail=n1+n2,rank=1,raise_at_step=4"}
    assert injected_problems(env, "n2") == [f"injected failure ({ENV_INJECT} node_check_fail)"]
    assert injected_problems(env, "n3") == [] and injected_problems({}, "n1") == []
    (problem,) = injected_problems({ENV_INJECT: "bogus=1"}, "n1")
    assert problem.startswith(f"{ENV_INJECT}: unknown point 'bogus'")


@pytest.mark.parametrize("in_config", [True, False])
def test_validate_refuses_a_bad_inject_before_any_rank_reads_it(
    tmp_path, capsys, monkeypatch, in_config
):
    """Every rank and every node's check would fail on it alike: one line, exit 2, up front."""
    env = f'env = {{ {ENV_INJECT} = "bogus=1" }}\n' if in_config else ""
    if not in_config:
        monkeypatch.setenv(ENV_INJECT, "bogus=1")
    text = f'[job]\nrun_dir = "{tmp_path}/runs"\n[launch]\nlauncher = "local"\n{env}'
    err = one_line_error(capsys, ["validate", str(write_job_toml(tmp_path, text))])
    key = "launch.env: " if in_config else ""
    assert f"job.toml: {key}{ENV_INJECT}: unknown point 'bogus'" in err


def test_the_worker_help_names_the_variable_and_every_point():
    """Where a test's failure points are set, for whoever looks for the flags they once were."""
    from worker import args as worker_args

    text = " ".join(worker_args.build_parser().format_help().split())
    assert f"{ENV_INJECT}=name=value" in text
    assert all(name in text for name, _, _ in inject.describe())


def test_every_point_is_documented():
    text = (DOCS / "architecture.md").read_text()
    missing = [name for name, _, _ in inject.describe() if f"`{name}`" not in text]
    assert not missing, f"docs/architecture.md lacks the failure points {missing}"
