"""Stacks read back (`supervisor.watch.stack_text`): faulthandler's and py-spy's output,
captured once from real processes (tests/unit/stack_dumps/README.md), as the main thread's
place and the event's lines; and the per-rank choice of how to read a rank's stacks."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from supervisor.commands.status import status_lines
from supervisor.log.events import render
from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from supervisor.reporting.report_md import render as render_md
from supervisor.reporting.report_md import stacks_md
from supervisor.reporting.summary import summary
from supervisor.watch.stack_text import (
    Frame,
    Place,
    RankStack,
    catches,
    detect,
    is_own_code,
    main_thread,
    method_for,
    parse_faulthandler,
    parse_pyspy,
    place_of,
    ranks_text,
    short_path,
    summary_lines,
    where,
)
from tests.support import events, synthetic_events, synthetic_metrics, write_run

DUMPS = Path(__file__).parent / "stack_dumps"


def dump(name: str) -> str:
    return (DUMPS / name).read_text()


def test_a_ranks_own_dump_in_a_collective():
    text = dump("faulthandler_in_collective.txt")
    assert detect(text) == "faulthandler"
    threads = parse_faulthandler(text)
    assert len(threads) == 3
    main = main_thread(text)
    assert main == threads[-1] and main.current  # the oldest thread is listed last
    assert main.frames[0] == Frame(
        "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
        4394,
        "all_gather_single",
    )
    assert main.frames[-1].func == "_run_module_as_main" and len(main.frames) == 20
    assert threads[0].frames[1] == Frame("/work/main/worker/beat.py", 257, "_run")
    place = place_of(text)
    assert place == Place(main.frames[0], Frame("/work/main/worker/loop.py", 81, "train_step"))
    assert place.text() == (
        "torch/distributed/distributed_c10d.py:4394 all_gather_single "
        "(from worker/loop.py:81 train_step)"
    )


def test_a_ranks_own_dump_in_its_own_code():
    text = dump("faulthandler_stalled.txt")
    place = place_of(text)
    assert place is not None and place.own == place.innermost
    assert place.text() == "worker/beat.py:348 apply"


def test_py_spy_on_a_stopped_rank():
    text = dump("pyspy_stopped.txt")
    assert detect(text) == "py-spy"
    threads = parse_pyspy(text)
    assert [t.name for t in threads] == ["MainThread", "es-stacks", "es-beacon"]
    assert threads[0].ident == "11946" and len(threads[0].frames) == 20
    assert threads[0].frames[0].func == "all_gather_single"
    assert threads[0].frames[14] == Frame("/work/main/worker/loop.py", 81, "train_step")
    assert threads[0].frames[-1] == Frame("<frozen runpy>", 198, "_run_module_as_main")
    # The same place, read from outside, as the rank's own dump gives; py-spy's qualified
    # function names read as faulthandler's.
    assert place_of(text).text() == place_of(dump("faulthandler_in_collective.txt")).text()
    assert threads[0].frames[2].func == "DefaultAllGather.__call__"
    fh = parse_faulthandler(dump("faulthandler_in_collective.txt"))[-1]
    assert (
        where(threads[0].frames[2])
        == where(fh.frames[2])
        == ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:119 __call__")
    )
    assert where(threads[0].frames[1]).endswith(":83 wrapper")  # _exception_logger.<locals>.


def test_py_spy_with_short_names_and_a_failed_py_spy():
    text = dump("pyspy_short_names.txt")
    main = main_thread(text)
    assert main is not None and main.name == "MainThread"
    assert place_of(text).text() == "prog.py:7 train_step"
    # Without --nonblocking py-spy cannot read a stopped process: a header, no thread.
    failed = dump("pyspy_blocking_on_stopped.txt")
    assert "Failed to suspend process" in failed
    assert parse_pyspy(failed) == [] and place_of(failed) is None


def test_py_spy_without_thread_names_takes_the_pids_thread():
    text = (
        "Process 42: python x.py\nPython v3.11.7 (/usr/bin/python3)\n\n"
        "Thread 43 (idle)\n    loop (x.py:3)\nThread 42 (active+gil)\n    main (x.py:9)\n"
    )
    assert main_thread(text).frames == (Frame("x.py", 9, "main"),)


def test_what_is_no_dump():
    for text in ("", "# rank 3: unknown\n# no stack: it never said hello\n", "garbage\n"):
        assert detect(text) == "" and main_thread(text) is None and place_of(text) is None
    # A thread without a Python frame has no place.
    assert (
        place_of("Current thread 0x00007f (most recent call first):\n  <no Python frame>\n") is None
    )


def test_paths_as_people_read_them():
    site = "/x/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    assert short_path(site) == "torch/distributed/distributed_c10d.py"
    assert short_path("/usr/lib/python3/dist-packages/zmq/poll.py") == "zmq/poll.py"
    assert short_path("/work/main/worker/loop.py") == "worker/loop.py"
    assert short_path("prog.py") == "prog.py" and short_path("<frozen runpy>") == "<frozen runpy>"
    assert is_own_code("/work/main/worker/loop.py") and is_own_code("prog.py")
    assert not is_own_code(site) and not is_own_code("<frozen runpy>")
    assert not is_own_code("/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py")


@pytest.mark.parametrize(
    "status, handles, method",
    [
        ("stopped", True, "py-spy"),  # SIGSTOPped: it cannot run its handler
        ("tracing-stop", True, "py-spy"),
        ("disk-sleep", True, "py-spy"),  # D state: the signal waits for the I/O
        ("sleeping", True, "signal"),  # blocked in a collective or a sleep: it dumps its own
        ("running", True, "signal"),
        ("running", False, "py-spy"),  # no handler: the signal would end it
        ("zombie", True, "none"),
        (None, False, "none"),  # gone
    ],
)
def test_how_a_ranks_stacks_are_read(status, handles, method):
    assert method_for(status, handles)[0] == method


def test_the_handler_mask():
    usr2 = int(signal.SIGUSR2)  # 12: bit 11
    assert catches("0000000000000800", usr2)
    assert catches("0000000180004202", usr2) is False  # INT, USR1, TERM
    assert catches("0000000180004202", int(signal.SIGTERM))  # bit 14
    assert not catches("zz", usr2)


def test_lines_per_rank_grouped_the_findings_first():
    f = Frame("/x/site-packages/torch/distributed/distributed_c10d.py", 4394, "all_gather_single")
    own = Frame("/w/worker/loop.py", 81, "train_step")
    waiting = Place(f, own)
    stacks = [
        RankStack(0, "running", "signal", waiting),
        RankStack(1, "stopped", "py-spy", Place(own, own)),
        RankStack(2, "running", "signal", waiting),
        RankStack(3, "running", "signal", waiting),
        RankStack(5, "unknown", "none", None, "it never said hello: its pid is unknown"),
    ]
    assert summary_lines(stacks, first=[1]) == [
        "rank 1 stopped in worker/loop.py:81 train_step",
        "ranks 0,2-3 running in torch/distributed/distributed_c10d.py:4394 all_gather_single "
        "(from worker/loop.py:81 train_step)",
        "rank 5 unknown: no stack (it never said hello: its pid is unknown)",
    ]
    assert stacks[1].line() == "rank 1 stopped in worker/loop.py:81 train_step"
    # Thousands of ranks, each somewhere else: the lines stay few.
    many = [RankStack(r, "running", "signal", Place(Frame("a.py", r, "f"))) for r in range(100)]
    lines = summary_lines(many, first=[7], limit=4)
    assert len(lines) == 4 and lines[0] == "rank 7 running in a.py:7 f"
    assert lines[1:3] == ["rank 0 running in a.py:0 f", "rank 1 running in a.py:1 f"]
    assert lines[3] == "… ranks 2-6,8-99 elsewhere (see the stack files)"


def test_ranks_as_ranges():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([5, 0, 1, 2, 7, 8]) == "ranks 0-2,5,7-8"


# --- the lines where people look: tail, status, the report -------------------------------------
LINES = [
    "rank 1 stopped in worker/loop.py:81 train_step",
    "rank 0 running in torch/distributed/distributed_c10d.py:4394 all_gather_single "
    "(from worker/loop.py:81 train_step)",
]


def run_with_stacks(tmp_path: Path) -> Path:
    evs = synthetic_events()
    i = next(i for i, e in enumerate(evs) if e["event"] == "hang")
    stacks_dir = str(tmp_path / "run" / "attempts" / "001" / "stacks")
    evs[i] = {**evs[i], "stacks_dir": stacks_dir, "stacks": LINES, "stacks_missing": [],
              "stacks_s": 0.12}  # fmt: skip
    return write_run(tmp_path / "run", evs, synthetic_metrics())


def test_tail_shows_a_line_per_rank_under_the_event(tmp_path):
    run = run_with_stacks(tmp_path)
    hang = next(e for e in events(run) if e["event"] == "hang")
    text = render(hang)
    head, *below = text.split("\n")
    assert "hang" in head and "stacks_dir=" in head and "stacks_s=0.12" in head
    assert "stacks_missing" not in head and "stopped in" not in head
    assert below == [f"    {line}" for line in LINES]


def test_status_names_the_stacks_of_the_last_failure(tmp_path):
    run = run_with_stacks(tmp_path)
    out = status_lines(events(run), {}, run)
    at = next(i for i, line in enumerate(out) if line.startswith("last failure: attempt 1"))
    assert out[at + 1] == f"  stacks: {run}/attempts/001/stacks"
    assert out[at + 2 :] == [f"    {line}" for line in LINES]


def test_the_report_has_a_line_per_failure_with_its_stacks(tmp_path):
    run = run_with_stacks(tmp_path)
    a = analyze(load_run(run))
    f1, f2 = a.failures
    assert f1.stacks_dir is None and f1.stacks == []  # an exit: no stacks
    assert f2.stacks_dir == f"{run}/attempts/001/stacks" and f2.stacks == LINES
    expected = f"- #2 (attempt 1, liveness): {'; '.join(LINES)} (`attempts/001/stacks/`)"
    assert stacks_md(a) == [expected]
    assert f"## Stacks at each hang or no progress\n\n{expected}\n" in render_md(a)
    assert f"  #2 stacks: {'; '.join(LINES)}" in summary(a, []).splitlines()
