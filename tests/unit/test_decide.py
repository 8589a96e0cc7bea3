"""The supervisor's decisions, as pure functions over plain facts (no processes, no clock)."""

from __future__ import annotations

import pytest

from contracts.exit_codes import ExitCode
from supervisor.policy.error_lines import MAX_ERROR_CHARS, error_of, is_warning
from supervisor.policy.exits import (
    Outcome,
    attempt_outcome,
    classify_exit,
    describe_returncode,
    said_why,
)
from supervisor.policy.liveness import Finding, RankState, judge_period, judge_ranks
from supervisor.policy.restarts import (
    AttemptRecord,
    backoff_delay,
    consecutive_unproductive,
    decide,
    early_repeat,
    made_progress,
    restarts_left,
    saved_progress,
    stuck_resume,
)
from supervisor.policy.standby_rules import (
    StandbyChoice,
    standby_choice,
    standby_ready,
    standby_retry_delay,
    standby_start_step,
    standby_unusable,
)
from supervisor.settings.config import HeartbeatConfig, ProgressConfig, RestartConfig

HB = HeartbeatConfig(
    interval_s=1.0,
    timeout_s=10.0,
    progress=ProgressConfig(init=60, load=100, train=30, save=200),
)


def rank(r, seen, progress, phase="train", step=5, **kw):
    return RankState(rank=r, last_seen=seen, last_progress=progress, phase=phase, step=step, **kw)


def test_healthy_ranks_give_no_finding():
    ranks = {0: rank(0, 99, 90), 1: rank(1, 99.5, 95)}
    assert judge_ranks(ranks, 2, now=100, launched_at=0, heartbeat=HB) is None


def test_liveness_lost_after_timeout():
    ranks = {0: rank(0, 99, 95), 1: rank(1, 89.5, 89.5)}
    f = judge_ranks(ranks, 2, now=100, launched_at=0, heartbeat=HB)
    assert f.kind == "hang" and f.ranks == (1,)
    assert f.deadline == pytest.approx(99.5)
    assert judge_ranks(ranks, 2, now=99.4, launched_at=0, heartbeat=HB) is None


def test_liveness_beats_progress_when_both():
    ranks = {0: rank(0, 99, 50), 1: rank(1, 80, 80)}
    assert judge_ranks(ranks, 2, now=100, launched_at=0, heartbeat=HB).kind == "hang"


def test_no_progress_uses_the_phase_timeout():
    # Beating (seen now) but the step has not moved for 31 s in train (timeout 30).
    ranks = {0: rank(0, 100, 69), 1: rank(1, 100, 99)}
    f = judge_ranks(ranks, 2, now=100, launched_at=0, heartbeat=HB)
    assert f.kind == "no_progress" and f.ranks == (0,) and f.phase == "train"
    assert f.deadline == pytest.approx(99)
    # The same stillness is fine while saving (timeout 200).
    ranks = {0: rank(0, 100, 69, phase="save"), 1: rank(1, 100, 99)}
    assert judge_ranks(ranks, 2, now=100, launched_at=0, heartbeat=HB) is None


def test_missing_rank_judged_by_init_timeout():
    ranks = {0: rank(0, 100, 99)}
    assert judge_ranks(ranks, 2, now=59, launched_at=0, heartbeat=HB) is None
    f = judge_ranks(ranks, 2, now=61, launched_at=0, heartbeat=HB)
    assert f.kind == "no_progress" and f.ranks == (1,) and "no hello" in f.reason


def test_a_worker_that_breaks_its_protocol_gets_a_line_naming_the_part():
    """docs/worker-protocol.md: a script of one's own that says no hello, never leaves `init`
    after it, or exits 0 without `done` is told which part it broke, in the attempt's line."""
    silent = attempt_outcome(None, 0, done=False, stopping=False, stepped=False, said_hello=False)
    assert silent.kind == "failure" and "no rank said hello" in silent.detail
    assert "worker-protocol" in silent.detail
    spoke = attempt_outcome(None, 0, done=False, stopping=False, stepped=True, said_hello=True)
    assert spoke.detail == "exit 0 before the worker said done"
    # A hello gives a rank its pid: one still in `init` past the limit said it or did not.
    hello = {0: rank(0, 100, 39, phase="init", step=0, pid=7)}
    f = judge_ranks(hello, 1, now=100, launched_at=0, heartbeat=HB)
    assert f.kind == "no_progress"
    assert f.reason == "said hello, then no phase or step for 61.0 s (init timeout 60 s)"
    beats = {0: rank(0, 100, 39, phase="init", step=0)}
    f = judge_ranks(beats, 1, now=100, launched_at=0, heartbeat=HB)
    assert f.reason.startswith("beats but no hello, no phase or step")
    # A step that stops moving says so (the progress limit of its phase).
    f = judge_ranks({0: rank(0, 100, 69, step=0, pid=7)}, 1, now=100, launched_at=0, heartbeat=HB)
    assert f.reason == "step 0 has not moved in phase 'train' for 31.0 s (timeout 30 s)"
    gone = {0: rank(0, 99, 99, phase="init", exited=True, exited_at=99.5)}
    f = judge_ranks(gone, 1, now=100, launched_at=0, heartbeat=HB)
    assert f.kind == "rank_exit" and f.reason.endswith("never having said hello")


def test_done_ranks_are_not_judged_and_gone_ranks_come_first():
    ranks = {0: rank(0, 0, 0, phase="done"), 1: rank(1, 0, 0, phase="done", exited=True)}
    assert judge_ranks(ranks, 2, now=1000, launched_at=0, heartbeat=HB) is None
    ranks = {0: rank(0, 50, 50), 1: rank(1, 99, 99, exited=True, exited_at=99.5)}
    f = judge_ranks(ranks, 2, now=100, launched_at=0, heartbeat=HB)
    assert f.kind == "rank_exit" and f.ranks == (1,) and f.deadline == 99.5


def test_a_rank_silent_since_its_error_has_ended():
    """Its error is a rank's last word: on another host (no pid watched, srun keeping the rest
    alive for Slurm's KillWait) a second of silence after it is its end, not a hang 10 s on."""
    ranks = {0: rank(0, 99.9, 99), 1: rank(1, 98.5, 98, said_error_at=98.5)}
    assert judge_ranks(ranks, 2, now=99.4, launched_at=0, heartbeat=HB) is None  # still ending
    f = judge_ranks(ranks, 2, now=99.6, launched_at=0, heartbeat=HB)
    assert f.kind == "rank_exit" and f.ranks == (1,) and f.deadline == pytest.approx(99.5)
    assert "silent since its error" in f.reason
    beating = {1: rank(1, 99.9, 98, said_error_at=98.5)}  # still alive, beating: not yet
    assert judge_ranks(beating, 1, now=100, launched_at=0, heartbeat=HB) is None


@pytest.mark.parametrize(
    "rc,done,stopping,stepped,kind",
    [
        (0, True, False, True, "success"),
        (0, False, True, True, "stopped"),
        (0, False, False, True, "failure"),
        (2, False, False, False, "bad_input"),
        (2, False, False, True, "failure"),
        (137, False, False, True, "failure"),
        (-9, False, False, True, "failure"),
        (1, True, False, True, "failure"),
        (3, False, False, True, "diverged"),
        (3, False, False, False, "diverged"),
    ],
)
def test_classify_exit(rc, done, stopping, stepped, kind):
    assert classify_exit(rc, done=done, stopping=stopping, stepped=stepped).kind == kind


GAVE_UP = "the numerical guard gave up: 10 bad steps in a row at step 2"


@pytest.mark.parametrize("stepped", [True, False])
@pytest.mark.parametrize("rc", [2, 3, -9, None])
def test_the_guards_give_up_is_the_outcome_whatever_was_seen_first(stepped, rc):
    """Issue 40: a diverging run's exit 2 after a step was a failure (relaunched from step 0
    until "no progress"), before any step (a resume from the memory tier) "bad input"; and a
    rank's end seen before the launcher's exit was a `rank_exit` failure. The ranks' word
    decides: the job ends at once, with the guard's line and an exit of its own."""
    finding = Finding("rank_exit", (0,), "rank 0 ended in phase train", "train", 2, 1.0)
    for seen in (finding, None):
        out = attempt_outcome(seen, rc, done=False, stopping=False, stepped=stepped,
                              diverged=GAVE_UP)  # fmt: skip
        assert out == Outcome("diverged", GAVE_UP)
        d = decide(out, [rec(0, 0, 1)], 0, CFG)
        assert (d.action, d.exit_code, d.reason) == ("stop", ExitCode.DIVERGED, GAVE_UP)
    # Diverged comes before an interrupt too: the job would end there either way.
    assert decide(Outcome("diverged", GAVE_UP), [rec(0, 0, 1)], 0, CFG, interrupted=True
                  ).exit_code == ExitCode.DIVERGED  # fmt: skip
    # A run that finished is not undone by a late word.
    done = attempt_outcome(None, 0, done=True, stopping=False, stepped=True, diverged=GAVE_UP)
    assert done.kind == "success"


@pytest.mark.parametrize("rc", [2, 1, -9, None])
def test_a_ranks_refusal_before_any_step_is_bad_input_whatever_was_seen_first(rc):
    """A rank that refuses its input (another model's checkpoint) says so (`cause` usage) and
    exits 2; its peers say it only after a grace, so the launcher's status can come after the
    rank's end was judged, or never before the teardown. The rank's word decides: bad input,
    the job ends with exit 2 and the rank's line, not a relaunch that would refuse again."""
    why = "checkpoint ck/step-2 is of another model"
    finding = Finding("rank_exit", (0,), "rank 0 ended in phase 'load'", "load", 0, 1.0)
    for seen in (finding, None):
        out = attempt_outcome(seen, rc, done=False, stopping=False, stepped=False, refused=why)
        assert out == Outcome("bad_input", f"the worker rejected its input: {why}")
        d = decide(out, [rec(0, 0, 0)], 0, CFG)
        assert (d.action, d.exit_code) == ("stop", ExitCode.USAGE)
    # The give-up reason is the message's last line, cut as an attempt's error line is.
    long = attempt_outcome(None, 2, done=False, stopping=False, stepped=False,
                           refused="Traceback\n" + "x" * 5000)  # fmt: skip
    assert long.detail == "the worker rejected its input: " + "x" * MAX_ERROR_CHARS
    # After a step, under a stop, or once done, the word does not decide (as for exit 2).
    for stepped, stopping, done in (
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ):
        out = attempt_outcome(None, 0, done=done, stopping=stopping, stepped=stepped, refused=why)
        assert out.kind != "bad_input"


def test_describe_returncode():
    assert describe_returncode(-9) == "killed by SIGKILL"
    assert describe_returncode(137) == "exit 137 (SIGKILL)"
    assert describe_returncode(1) == "exit 1"


def rec(attempt, resume, reached, saved=None):
    return AttemptRecord(attempt, resume, reached, saved_step=saved)


def test_progress_and_backoff():
    assert made_progress(rec(0, 0, 3), 1)
    assert not made_progress(rec(0, 10, 10), 1)
    assert not made_progress(rec(0, None, None), 1)
    history = [rec(0, 0, 20), rec(1, 20, 20), rec(2, None, None)]
    assert consecutive_unproductive(history, 1) == 2
    schedule = [0, 1, 5]
    assert [backoff_delay(n, schedule) for n in range(5)] == [0, 1, 5, 5, 5]


def test_stuck_resume():
    assert stuck_resume([rec(0, 10, 12), rec(1, 10, 13), rec(2, 10, 11)], 3) == [10, 10, 10]
    assert stuck_resume([rec(0, 5, 12, 10), rec(1, 10, 13), rec(2, 10, 11)], 3) is None
    assert stuck_resume([rec(0, 10, 12), rec(1, 10, 13)], 3) is None
    assert stuck_resume([rec(0, None, None)] * 3, 3) is None
    # A checkpoint of the resume step itself, or an older one, is no progress; nor is a fall
    # back to an older checkpoint (a damaged one skipped).
    assert stuck_resume([rec(0, 10, 12, 10), rec(1, 10, 13, 5), rec(2, 5, 9)], 3) == [10, 10, 5]


def test_progress_is_a_completed_checkpoint_newer_than_the_resume_step():
    """Issue 25: kills at steps 4, 7 and 14, a save every 10: three attempts resume from step 0,
    but the third completed the checkpoint of step 10; the next resumes there."""
    history = [rec(0, 0, 4), rec(1, 0, 7), rec(2, 0, 14, 10)]
    assert [saved_progress(r) for r in history] == [False, False, True]
    d = decide(FAIL, history, 2, CFG_LARGE_BUDGET)
    assert d.action == "relaunch"
    # A memory-tier copy counts the same (the record holds the newest of both tiers).
    assert decide(FAIL, [rec(0, 0, 4, 3), rec(1, 3, 7, 6), rec(2, 6, 9, 8)], 2,
                  CFG_LARGE_BUDGET).action == "relaunch"  # fmt: skip
    # max_same_resume attempts in a row without one: the job stops.
    d = decide(FAIL, [*history, rec(3, 10, 14), rec(4, 10, 12), rec(5, 10, 11)], 5,
               CFG_LARGE_BUDGET)  # fmt: skip
    assert d.exit_code == ExitCode.NO_PROGRESS and d.facts == {"resume_step": 10}
    assert d.reason == (
        "no progress: 3 attempts in a row resumed from step 10 and completed no newer checkpoint"
    )
    d = decide(FAIL, [rec(0, 10, 12, 10), rec(1, 10, 13, 5), rec(2, 5, 9)], 2, CFG_LARGE_BUDGET)
    assert d.exit_code == ExitCode.NO_PROGRESS and d.facts == {"resume_step": 5}
    assert d.reason.endswith("completed no checkpoint newer than the one each resumed from "
                             "(steps 10, 10, 5)")  # fmt: skip


CFG_LARGE_BUDGET = RestartConfig(max_restarts=10, max_same_resume=3)


CFG = RestartConfig(max_restarts=3, backoff_s=[0, 2, 10], max_same_resume=3)
FAIL = Outcome("failure", "exit 9")


def test_decide_paths():
    assert decide(Outcome("success", ""), [rec(0, 0, 30)], 0, CFG).exit_code == ExitCode.DONE
    d = decide(FAIL, [rec(0, 0, 12)], 0, CFG)
    assert d.action == "relaunch" and d.delay_s == 0
    d = decide(FAIL, [rec(0, 0, 12), rec(1, 10, 10)], 1, CFG)
    assert d.action == "relaunch" and d.delay_s == 2
    d = decide(FAIL, [rec(0, 0, 12), rec(1, 10, 11)], 3, CFG)
    assert d.action == "stop" and d.exit_code == ExitCode.BUDGET
    stuck = [rec(0, 10, 12), rec(1, 10, 13), rec(2, 10, 11)]
    d = decide(FAIL, stuck, 2, CFG)
    assert d.exit_code == ExitCode.NO_PROGRESS and d.facts["resume_step"] == 10
    assert decide(Outcome("bad_input", ""), [rec(0, None, None)], 0, CFG).exit_code == 2
    d = decide(Outcome("stopped", ""), [rec(0, 0, 5)], 0, CFG)
    assert d.exit_code == ExitCode.INTERRUPTED
    assert decide(FAIL, [rec(0, 0, 5)], 0, CFG, interrupted=True).exit_code == 5
    assert restarts_left(3, 5) == 0 and restarts_left(3, 1) == 2


def test_judge_period_stretches_for_large_jobs():
    assert judge_period(2, 0.1) == 0.1
    assert judge_period(10_000, 0.1) == pytest.approx(0.2)
    assert judge_period(100_000, 0.1) == pytest.approx(2.0)


def test_error_of_prefers_the_ranks_own_words_then_the_output():
    assert error_of({1: "Traceback...\nValueError: x", 0: "RuntimeError: y"}, []) == (
        "RuntimeError: y"
    )
    tail = ["[0] step 3", "[1] ssh: Could not resolve hostname n9: Name or service not known", ""]
    assert error_of({}, tail) == "ssh: Could not resolve hostname n9: Name or service not known"
    assert error_of({}, ["[0] step 3 loss 1.0"]) is None


def test_a_warning_is_never_the_error():
    off = "WARNING: memory tier off: a copy failed (OSError: [Errno 28] No space left on device)"
    # Issue 25: an attempt ended by an injected kill after rank 0 warned.
    assert error_of({}, ["[0] step 3", f"[0] {off}", "[0] step 4"]) is None
    assert error_of({}, ["[0] RuntimeError: boom", f"[0] {off}"]) == "RuntimeError: boom"
    py = [
        "[1] /x/torch/utils.py:12: UserWarning: TypedStorage failed to do something",
        "[1]   warnings.warn('cannot do it')",
        "[1] [W1203 12:00:00.1 socket.cpp:663] [c10d] The client socket has failed to connect",
        "[0] WARNING: skipping checkpoint step-35: its shard cannot be read; trying the one before",
        "[0] warning: checkpoint step=10 failed: disk error",
    ]
    assert error_of({}, py) is None
    # The rank's own error still comes first; an indented line after no warning still counts.
    assert error_of({0: "RuntimeError: y"}, [off]) == "RuntimeError: y"
    assert error_of({}, ["Traceback (most recent call last):", "  OSError: cannot open"]) == (
        "OSError: cannot open"
    )
    assert is_warning(off) and not is_warning("ValueError: warning level too high")
    assert not is_warning("warnings.warn failed")


def test_the_same_early_error_twice_stops_with_it():
    cfg = RestartConfig(max_restarts=10)
    boom = "ZeroDivisionError: integer division or modulo by zero"
    history = [AttemptRecord(0, None, None, "failure", boom)]
    assert decide(Outcome("failure", "exit 1"), history, 0, cfg).action == "relaunch"
    history.append(AttemptRecord(1, None, None, "failure", boom))
    d = decide(Outcome("failure", "exit 1"), history, 1, cfg)
    assert (d.action, d.exit_code) == ("stop", ExitCode.NO_PROGRESS)
    assert d.reason.endswith(boom)
    # Different errors, an attempt that stepped, or no error said: no verdict.
    assert early_repeat([AttemptRecord(0, None, None, "failure", "A"),
                         AttemptRecord(1, None, None, "failure", "B")]) is None  # fmt: skip
    assert early_repeat([AttemptRecord(0, 0, 3, "failure", boom),
                         AttemptRecord(1, None, None, "failure", boom)]) is None  # fmt: skip
    assert early_repeat([AttemptRecord(0, None, None, "failure", None)] * 2) is None


def test_a_host_that_does_not_resolve_ends_the_job_at_once():
    said = "ssh: Could not resolve hostname no-such-host-xyz: Name or service not known"
    d = decide(Outcome("failure", "exit 255"), [AttemptRecord(0, None, None, "failure", said)],
               0, RestartConfig())  # fmt: skip
    assert (d.action, d.exit_code) == ("stop", ExitCode.USAGE)
    assert "host 'no-such-host-xyz' does not resolve" in d.reason


def test_a_waiting_standby_has_no_progress_limit_but_liveness_still_applies():
    waiting = {0: rank(0, 999, 0, phase="standby"), 1: rank(1, 999, 0, phase="standby")}
    assert judge_ranks(waiting, 2, now=1000, launched_at=0, heartbeat=HB, waiting=True) is None
    told_to_go = judge_ranks(waiting, 2, now=1000, launched_at=0, heartbeat=HB)  # load limit: 100 s
    assert told_to_go is not None and told_to_go.kind == "no_progress"
    silent = {0: rank(0, 900, 0, phase="standby"), 1: rank(1, 999, 0, phase="standby")}
    lost = judge_ranks(silent, 2, now=1000, launched_at=0, heartbeat=HB, waiting=True)
    assert lost is not None and lost.kind == "hang" and lost.ranks == (0,)
    preparing = {0: rank(0, 999, 0, phase="init")}  # a standby still starting: the init limit
    stuck = judge_ranks(preparing, 1, now=1000, launched_at=0, heartbeat=HB, waiting=True)
    assert stuck is not None and stuck.kind == "no_progress"


def test_a_standby_is_ready_when_every_rank_waits():
    assert not standby_ready({0: rank(0, 1, 1, phase="standby")}, 2)
    assert not standby_ready({0: rank(0, 1, 1, phase="standby"), 1: rank(1, 1, 1, "init")}, 2)
    assert standby_ready({r: rank(r, 1, 1, phase="standby") for r in range(2)}, 2)


def test_which_standby_can_take_over():
    assert standby_unusable(True, True, ["a", "b"], []) is None
    assert standby_unusable(True, False, ["a"], []) == "no standby running"
    assert standby_unusable(False, True, ["a"], []) == "the standby was not ready"
    on_b = standby_unusable(True, True, ["a", "b"], ["b"])
    assert on_b == "the standby runs on the failed node b"
    lost_with_b = standby_unusable(True, False, ["a", "b"], ["b"])  # a node loss took it too
    assert lost_with_b.startswith("the standby ended with the failed node b: ")
    assert "a spare cannot join" in lost_with_b


def test_a_standby_is_used_waited_for_or_dropped():
    assert standby_choice(True, True, ["a"], []) == StandbyChoice("use")
    gone = standby_choice(False, False, [], [], prepare_s=10.0)
    assert gone == StandbyChoice("drop", "no standby running")
    on_bad = standby_choice(False, True, ["a", "b"], ["b"], starting_s=9.0, prepare_s=10.0)
    assert on_bad.action == "drop" and "failed node b" in (on_bad.why or "")
    unready = "the standby was not ready"
    # No standby has been ready yet: nothing says how long this one needs, so no wait.
    assert standby_choice(False, True, ["a"], [], starting_s=9.0) == StandbyChoice("drop", unready)
    # Just launched: a cold launch costs no more than waiting for all of its start.
    early = standby_choice(False, True, ["a"], [], starting_s=0.1, prepare_s=10.0)
    assert early == StandbyChoice("drop", unready)
    # Not yet half-way: waiting saves less than the estimate may be off.
    assert standby_choice(False, True, ["a"], [], starting_s=4.0, prepare_s=10.0).action == "drop"
    # Well along: wait for the rest of its start, with a slack, rather than redo it all.
    late = standby_choice(False, True, ["a"], [], starting_s=8.0, prepare_s=10.0)
    assert late == StandbyChoice("wait", unready, 2.5)
    overdue = standby_choice(False, True, ["a"], [], starting_s=12.0, prepare_s=10.0)
    assert overdue == StandbyChoice("wait", unready, 0.5)
    # A quick start (under a second) is never waited for: a cold one is as quick.
    assert standby_choice(False, True, ["a"], [], starting_s=0.9, prepare_s=1.0).action == "drop"


def test_the_next_standby_starts_once_the_failure_s_lost_steps_are_redone():
    assert standby_start_step(1, None) == 1  # the job's first attempt: at its first step
    assert standby_start_step(13, 12) == 13  # nothing lost: its first step is past 12
    assert standby_start_step(12, 12) == 13  # one step to redo: once past it
    assert standby_start_step(10, 12) == 13  # three
    assert standby_start_step(9, 12) == 9  # four: a long recompute, a standby at once
    assert standby_start_step(21, 20) == 21  # resumed past it (a graceful stop's save)


def test_a_lost_standby_is_retried_with_a_backoff_then_given_up():
    schedule = [0.0, 2.0, 5.0]
    delays = [standby_retry_delay(n, schedule) for n in range(1, 6)]
    assert delays == [1.0, 2.0, 5.0, 5.0, None]


def test_a_divergence_known_by_its_exit_alone_takes_the_ranks_line():
    out = classify_exit(3, done=False, stopping=False, stepped=True)
    assert said_why(out, GAVE_UP) == Outcome("diverged", GAVE_UP)
    assert said_why(out, None) == out  # no line: the exit's own words
    assert said_why(Outcome("failure", "exit 1"), GAVE_UP).kind == "failure"


def test_an_allocation_gone_stops_the_job_at_once():
    """srun saying its allocation is over (scancel, the time limit, a node failed without
    --no-kill): no relaunch can start, so none is tried (before: two more, then no progress)."""
    gone = "srun: error: Slurm job 5 has expired"
    history = [AttemptRecord(0, 0, 30, "failure", "srun: error: n2: task 0: Killed"),
               AttemptRecord(1, 29, None, "failure", gone)]  # fmt: skip
    d = decide(Outcome("failure", "exit 1"), history, 1, CFG_LARGE_BUDGET)
    assert (d.action, d.exit_code) == ("stop", ExitCode.NODES)
    assert "the Slurm allocation is gone" in d.reason and "--no-kill" in d.reason
    revoked = AttemptRecord(0, 0, 9, "failure", "salloc: Job allocation 12 has been revoked.")
    assert decide(FAIL, [revoked], 0, CFG_LARGE_BUDGET).exit_code == ExitCode.NODES
