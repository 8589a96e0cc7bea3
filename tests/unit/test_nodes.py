"""The job's nodes: failures laid on a node, exclusion, spares, shrink (pure functions), and the
config and command that name them."""

from __future__ import annotations

import pytest

from contracts.config_table import ConfigError
from supervisor.launch.registry import launcher_for
from supervisor.policy.nodes import (
    FailureFacts,
    NodePool,
    attribute,
    exclude,
    excluded_now,
    first_exited,
    launcher_named_ranks,
    outside_collectives,
)
from supervisor.settings import config as config_mod
from supervisor.settings import loading

FOUR = ("n0", "n1", "n2", "n3")


def test_the_last_nodes_are_the_spares_and_ranks_sit_in_blocks():
    pool = NodePool.split(["a", "b", "c", "d"], 1)
    assert pool.active == ("a", "b", "c") and pool.spares == ("d",)
    assert [pool.node_of(r, 2) for r in range(6)] == ["a", "a", "b", "b", "c", "c"]


@pytest.mark.parametrize(
    "facts, node, why",
    [
        (FailureFacts("exit", injected=(1,), first_exited=(0,)), "n1", "injected"),
        (FailureFacts("exit", error_ranks=(2,), first_exited=(1,)), "n2", "error"),
        (FailureFacts("hang", finding_ranks=(3,)), "n3", "beats"),
        (FailureFacts("exit", first_exited=(2,), launcher_named=(0,)), "n2", "process ended"),
        (FailureFacts("exit", launcher_named=(1,)), "n1", "launcher"),
    ],
)
def test_a_failure_is_laid_on_the_node_of_its_most_telling_fact(facts, node, why):
    got = attribute(facts, FOUR, 1)
    assert got.node == node and why in got.why


def test_ranks_stuck_waiting_in_a_collective_are_not_the_stalled_ones():
    places = {
        0: "worker/beat.py:348 apply",
        1: "torch/distributed/distributed_c10d.py:4394 all_gather_single",
        2: "torch/distributed/distributed_c10d.py:4394 all_gather_single",
    }
    stalled = outside_collectives(places)
    assert stalled == (0,)
    facts = FailureFacts(
        "no_progress", finding_ranks=(0, 1, 2), stalled_outside_collectives=stalled
    )
    assert attribute(facts, ("a", "b", "c"), 1).node == "a"
    # Without stacks every stalled rank counts: they span the nodes, so no node.
    assert attribute(FailureFacts("no_progress", finding_ranks=(0, 1, 2)), FOUR, 1).node is None


def test_no_node_when_the_facts_span_nodes_or_the_job_has_one():
    spans = attribute(FailureFacts("exit", injected=(0, 1, 2, 3)), FOUR, 1)
    assert spans.node is None and "span" in spans.why
    # The same error raised on every node is the job's (a bug, bad data), not a node's.
    assert (
        attribute(FailureFacts("exit", error_ranks=(2, 0), first_exited=(2,)), FOUR, 1).node is None
    )
    # Two ranks of one node (2 per node) still name it.
    assert attribute(FailureFacts("exit", injected=(2, 3)), FOUR, 2).node == "n1"
    alone = attribute(FailureFacts("hang", finding_ranks=(1,)), ("vm",), 2)
    assert alone.node is None and "only active node" in alone.why
    assert attribute(FailureFacts("exit"), FOUR, 1).node is None
    # A rank beyond the world (a straggler's claim) is no fact.
    assert attribute(FailureFacts("exit", launcher_named=(9,)), FOUR, 1).node is None


def test_a_peers_loss_in_a_survivors_words_is_not_its_own_error():
    from supervisor.policy.nodes import own_errors

    errors = {
        0: "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:35533: "
        "Connection reset by peer. This is typically caused by a remote worker hanging",
        2: "ValueError: loss is nan at step 7",
        3: "ValueError: late",
    }
    at = {0: 1.0, 2: 1.5, 3: 9.0}
    assert own_errors(errors, at, first_gone=5.0) == (2,)  # 3 came after a rank was gone


def test_the_launchers_first_bad_termination_names_a_rank_by_pid():
    tail = [
        "[0] step 8/30 loss 5.1",
        "===================================================================================",
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
        "=   PID 17890 RUNNING AT n1",
        "=   EXIT CODE: 9",
    ]
    assert launcher_named_ranks(tail, {0: 17880, 1: 17890}) == (1,)
    assert launcher_named_ranks(tail, {0: 17880}) == ()  # not a pid of ours


def test_ranks_seen_gone_at_the_same_moment_are_first_together():
    assert first_exited({0: 5.0, 1: 4.2, 2: 4.9}) == (1,)
    assert first_exited({0: 4.2, 1: 4.2, 2: 4.9}) == (0, 1)
    assert first_exited({}) == ()


def test_a_node_is_excluded_at_exclude_after_and_never_with_zero():
    pool = NodePool(("a", "b", "c"))
    assert excluded_now({"b": 1}, 2, pool) == []
    assert excluded_now({"b": 2, "x": 5}, 2, pool) == ["b"]  # x is not active
    assert excluded_now({"b": 9}, 0, pool) == []


def test_a_spare_takes_the_excluded_nodes_place_so_ranks_keep_their_numbers():
    change = exclude(NodePool(("a", "b", "c"), ("d", "e")), ["b"], shrink=False, min_nodes=1)
    assert change.action == "swap" and change.swaps == (("b", "d"),)
    assert change.pool == NodePool(("a", "d", "c"), ("e",), ("b",))


def test_without_a_spare_the_job_shrinks_or_stops():
    pool = NodePool(("a", "b", "c"))
    shrunk = exclude(pool, ["b"], shrink=True, min_nodes=2)
    assert shrunk.action == "shrink" and shrunk.pool == NodePool(("a", "c"), (), ("b",))
    stop = exclude(pool, ["b"], shrink=False, min_nodes=1)
    assert stop.action == "stop" and "shrink = true" in stop.reason and "spares" in stop.reason
    below = exclude(NodePool(("a", "c"), (), ("b",)), ["c"], shrink=True, min_nodes=2)
    assert below.action == "stop" and "min_nodes = 2" in below.reason
    assert below.pool.excluded == ("b", "c")


def test_two_nodes_out_at_once_take_a_spare_each_then_shrink():
    change = exclude(NodePool(("a", "b", "c"), ("d",)), ["a", "c"], shrink=True, min_nodes=1)
    assert change.action == "shrink" and change.swaps == (("a", "d"),)
    assert change.pool.active == ("d", "b")


# --- config and command ------------------------------------------------------------------------
def _cfg(**launch) -> config_mod.Config:
    raw = {"launch": {"launcher": "mpiexec", **launch}, "worker": {"model": "debug"}}
    return loading.from_dict(raw, "job.toml")


def test_emulated_nodes_need_mpiexec_and_a_list_of_names():
    with pytest.raises(ConfigError, match="launch.emulate_nodes"):
        loading.from_dict({"launch": {"launcher": "local", "emulate_nodes": True}}, "j")
    with pytest.raises(ConfigError, match="launch.nodes"):
        _cfg(emulate_nodes=True)


@pytest.mark.parametrize(
    "launch, restart, key",
    [
        ({"nodes": ["a", "b"], "spares": 2}, {}, "launch.spares"),
        ({"nodes": ["a", "b"], "spares": -1}, {}, "launch.spares"),
        ({"nodes": ["a", "b", "c"], "spares": 1}, {"min_nodes": 3}, "restart.min_nodes"),
        ({}, {"exclude_after": -1}, "restart.exclude_after"),
        ({}, {"min_nodes": 0}, "restart.min_nodes"),
    ],
)
def test_node_keys_that_cannot_work_are_config_errors(launch, restart, key):
    raw = {"launch": {"launcher": "mpiexec", **launch}, "restart": restart}
    with pytest.raises(ConfigError, match=key):
        loading.from_dict(raw, "job.toml")


def test_emulated_nodes_run_under_hydras_fork_launcher_with_the_smaller_worlds_flags(tmp_path):
    cfg = _cfg(emulate_nodes=True, nodes=["n0", "n1", "n2"], spares=1)
    plan = launcher_for("mpiexec").plan(
        cfg, ["n0", "n2"], "/bin/mpiexec", "hydra", {}, tmp_path / "hostfile",
        overrides={"batch_size": 3},
    )  # fmt: skip
    argv = plan.procs[0].argv
    assert argv[argv.index("-launcher") + 1] == "fork"
    assert argv[argv.index("-hosts") + 1] == "n0,n2"
    assert argv[argv.index("-n") + 1] == "2" and plan.world == 2
    assert argv[argv.index("--batch-size") + 1] == "3"


# --- the pre-launch check ---------------------------------------------------------------------
def test_the_pre_launch_check_reads_reports_among_the_launchers_words():
    from supervisor.host.node_check import MARK, judge

    lines = [
        f'[0] {MARK}{{"node": "n0", "problems": []}}[0] ',  # Hydra's next prefix after it
        f'[2] {MARK}{{"node": "n2", "problems": ["/ckpt: cannot write in /ckpt (Read-only)"]}}',
        "[mpiexec@vm] some words of the launcher",
        f"[1] {MARK}not json",
        f'[3] {MARK}{{"node": "n3", "problems": []}}[4] {MARK}{{"node": "n4", "problems": []}}',
    ]
    got = judge(lines, ["n0", "n1", "n2", "n3", "n4"])
    assert got.reported == 4
    assert got.failed == {
        "n1": "no report: a process could not be started there",
        "n2": "/ckpt: cannot write in /ckpt (Read-only)",
    }
    # Nothing reported at all: the launcher failed, which says nothing about one node.
    assert judge(["mpiexec: command not found"], ["n0", "n1"]).failed == {}


def test_the_silent_nodes_are_checked_again_each_alone_and_that_word_stands():
    """A dead host fails a launch over ssh for all, and the others' reports may be cut short
    with it (seen on the test bed: n0 and n2 silent beside the dead n1): the silent ones are
    checked again, each alone, and only what that says of them counts."""
    from supervisor.host.node_check import NO_REPORT, CheckResult, merge

    first = CheckResult({"n0": NO_REPORT, "n1": NO_REPORT, "n2": NO_REPORT, "n4": "full"}, 2)
    assert first.silent() == ["n0", "n1", "n2"]
    again = CheckResult({"n1": NO_REPORT}, 2)  # n0 and n2 answered alone, n1 did not
    assert merge(first, again, first.silent()) == CheckResult({"n4": "full", "n1": NO_REPORT}, 4)
    # nothing heard alone either: the silent ones stay silent, the others' words stand
    assert merge(first, CheckResult({}, 0), ["n0", "n1", "n2"]).failed == first.failed
    # nothing heard at all, twice: the launcher's failure, no node's
    assert merge(CheckResult({}, 0), CheckResult({}, 0), ["n0", "n1"]) == CheckResult({}, 0)


def test_a_directory_is_checked_where_it_would_be_made(tmp_path):
    from supervisor.host.node_check import dirs_to_check
    from supervisor.host.node_probe import writable_problem

    assert writable_problem(str(tmp_path / "not" / "yet")) is None
    (tmp_path / "file").write_text("")
    assert "not a directory" in writable_problem(str(tmp_path / "file" / "ckpt"))
    flags = {"ckpt_dir": "/c", "async_ckpt": True, "mem_ckpt_interval": 1}
    env = {"TMPDIR": str(tmp_path), "ES_MEM_ROOT": "/m"}
    assert dirs_to_check(flags, env) == ["/c", str(tmp_path), "/m"]
    assert dirs_to_check({"ckpt_dir": "/c", "ckpt_stage_dir": "/s"}, env) == ["/c"]


def test_a_stop_leaves_no_node_both_excluded_and_active_or_spare():
    """The spare failed its check and an active node fails: the job stops, and its pool names
    each node once (before: n3 both a spare and excluded, n1 both active and excluded)."""
    pool = NodePool(("n0", "n1", "n2"), ("n3",), ())
    change = exclude(pool, ["n3", "n1"], shrink=False, min_nodes=1)
    assert change.action == "stop"
    assert (change.pool.active, change.pool.spares) == (("n0", "n2"), ())
    assert set(change.pool.excluded) == {"n1", "n3"}


def test_validate_s_line_counts_the_active_nodes_and_says_the_spares_apart(tmp_path):
    """Issue 40, item 9: 2 active nodes and 1 spare of 2 ranks each were `3 node(s) x 2 ranks
    = 4`, a product that is not one."""
    from supervisor.launch.resolve import Resolved

    cfg = _cfg(emulate_nodes=True, nodes=["n0", "n1", "n2"], spares=1, ranks_per_node=2)
    line = Resolved(cfg, tmp_path, ["n0", "n1", "n2"], "/bin/mpiexec", "hydra").summary()
    assert "2 node(s) x 2 ranks = 4 + 1 spare," in line, line
    one = _cfg(ranks_per_node=2)
    line = Resolved(one, tmp_path, ["localhost"], "/bin/mpiexec", "hydra").summary()
    assert "1 node(s) x 2 ranks = 2, worker" in line, line


def test_a_survivor_s_connection_closed_by_peer_is_no_rank_error():
    """Issue 40, item 9: rank 1 killed, rank 0's gloo says "Connection closed by peer": that was
    a `rank_error` (an error event, and the attempt's error line, rank 0 being the lowest)."""
    from contracts import messages
    from supervisor.policy.error_lines import error_of
    from supervisor.watch.rank_table import AttemptTable
    from tests.support import BEACON_JOB

    peer = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1234"
    t = AttemptTable(attempt=0, world=2, launched_at=0.0)
    zero, one = (messages.RankIdentity(BEACON_JOB, 0, r, 2, "h", 7) for r in (0, 1))
    (said,) = t.update(zero.message("error", 1.0, message=peer), 1.0)
    assert (said.event, said.fields) == ("rank_peer_lost", {"rank": 0, "message": peer})
    (said,) = t.update(one.message("error", 1.0, message="ValueError: injected"), 1.0)
    assert said.event == "rank_error"
    assert error_of(t.errors, []) == "ValueError: injected"  # the rank's own, not the survivor's
    assert error_of({0: peer}, []) == peer  # nothing else said: still a line


BANNER = [
    "[0] step 236/100000 loss 10.6730 dt 451.7ms tps 2267",
    "",
    "===================================================================================",
    "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
    "=   PID 3775 RUNNING AT vm",
    "=   EXIT CODE: 9",
    "=   CLEANING UP REMAINING PROCESSES",
    "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES",
    "===================================================================================",
    "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)",
    "This typically refers to a problem with your application.",
    "Please see the FAQ page for debugging suggestions",
]  # an injected kill's attempts/NNN/output.log, as MPICH Hydra writes it


def test_mpich_s_bad_termination_banner_is_one_line_on_the_console():
    """Issue 40, item 9: every injected kill put MPICH's 10-line banner ("... Please see the
    FAQ page ...") on the console; it is one line there with its facts, whole in output.log."""
    import io

    from supervisor.run.attempt_events import fold_banners, show_tail

    tail = [*BANNER, "[1] after it"]
    folded = fold_banners(tail)
    assert folded == [
        BANNER[0],
        "[mpiexec] BAD TERMINATION: PID 3775 RUNNING AT vm, EXIT CODE: 9, Killed (signal 9); "
        "the banner whole in output.log",
        "[1] after it",
    ]
    console = io.StringIO()
    show_tail(console, 3, tail)
    text = console.getvalue()
    assert "FAQ" not in text and "=====" not in text and text.count("BAD TERMINATION") == 1
    assert launcher_named_ranks(tail, {1: 3775}) == (1,)  # the attribution reads it whole
    assert fold_banners(BANNER[3:]) == BANNER[3:]  # not seen from its first rule: as it is
    assert fold_banners(["=" * 40, "no banner"]) == ["=" * 40, "no banner"]
