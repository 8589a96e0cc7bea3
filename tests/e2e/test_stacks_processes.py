"""Stacks collected from real processes (`supervisor.watch.stacks.collect`,
`worker.stack_dump`): a rank that can run dumps its own on SIGUSR2, a SIGSTOPped one is read
by py-spy, one without the handler is read by py-spy and not killed by a signal it cannot take;
ranks that cannot be read (no pid, no process of ours, on another host) get a file and a line
that say why."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from contracts import control_msgs, env_names, stack_files
from supervisor.policy.liveness import RankState
from supervisor.watch import stacks
from supervisor.watch.control import ControlServer
from supervisor.watch.stack_text import place_of
from tests.support import REPO

RANK = """
import os, signal, sys, time
from worker import stack_dump
from worker.beat import Beacon
if sys.argv[1] == "handler":
    stack_dump.install(os.environ, int(sys.argv[2]))
signal.signal(signal.SIGUSR1, lambda *_: print("usr1", flush=True))
beacon = Beacon.from_env(int(sys.argv[2]), 2)  # with ES_CONTROL_ADDR: the control channel

def spin():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)

spin()
"""
READY_S = 30
KEY = b"k" * 32


def in_spin(place) -> bool:
    """The main thread in `spin` (in its loop, or still at its print)."""
    f = place.innermost
    return (Path(f.file).name, f.func) == ("rank.py", "spin") and place.own == f


def start(
    tmp_path: Path, attempt_dir: Path | None, mode: str, rank: int, control: str | None = None
) -> subprocess.Popen:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ES_")}
    env["PYTHONPATH"] = str(REPO)
    if attempt_dir is not None:
        env[env_names.ENV_ATTEMPT_DIR] = str(attempt_dir)
    if control is not None:
        env.update({
            env_names.ENV_HEARTBEAT_ADDR: "tcp://127.0.0.1:9",  # nobody listens: beats are lost
            env_names.ENV_HEARTBEAT_KEY: KEY.decode(),
            env_names.ENV_JOB_ID: "job",
            env_names.ENV_ATTEMPT: "0",
            env_names.ENV_CONTROL_ADDR: control,
        })  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(rank)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ready, _, _ = select.select([proc.stdout], [], [], READY_S)
    assert ready and proc.stdout.readline() == "ready\n", proc.stderr.read()
    return proc


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        p.kill()
        p.communicate(timeout=10)


def test_each_rank_read_the_way_its_state_allows(tmp_path, procs):
    attempt = tmp_path / "attempts" / "003"
    host = socket.gethostname()
    procs += [start(tmp_path, attempt, "handler", 0), start(tmp_path, attempt, "handler", 1),
              start(tmp_path, attempt, "plain", 2)]  # fmt: skip
    os.kill(procs[1].pid, signal.SIGSTOP)
    deadline = time.monotonic() + READY_S  # the stop is delivered asynchronously
    while psutil.Process(procs[1].pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "SIGSTOP not taken"
        time.sleep(0.01)
    ranks = {r: RankState(r, 0.0, 0.0, host=host, pid=p.pid) for r, p in enumerate(procs)}
    ranks[3] = RankState(3, 0.0, 0.0, host=host, pid=os.getppid())  # not a process of ours
    ranks[4] = RankState(4, 0.0, 0.0, host="elsewhere", pid=4242)
    # rank 5 never said hello
    got = asyncio.run(stacks.collect(attempt, ranks, 6, this_host=host))
    assert got.directory == attempt / "stacks"
    by_rank = {s.rank: s for s in got.stacks}
    assert sorted(by_rank) == list(range(6))
    files = {r: (attempt / "stacks" / f"rank-{r}.txt").read_text() for r in range(6)}

    # Running, with the handler: its own faulthandler dump of every thread.
    s0 = by_rank[0]
    assert (s0.state, s0.how) == ("running", "signal"), s0
    assert in_spin(s0.place)  # time.sleep is C: the loop's line is the innermost frame
    assert "its own dump (faulthandler, all threads, on SIGUSR2)" in files[0]
    assert "es-stacks" not in files[0] and files[0].count("(most recent call first)") == 2
    # SIGSTOPped: py-spy, which does not need it to run (and leaves it stopped).
    s1 = by_rank[1]
    assert (s1.state, s1.how) == ("stopped", "py-spy")
    assert in_spin(s1.place)
    assert "py-spy dump --nonblocking" in files[1] and '"MainThread"' in files[1]
    assert psutil.Process(procs[1].pid).status() == psutil.STATUS_STOPPED
    # No handler for SIGUSR2 (its default action would end it): py-spy, and it lives on.
    s2 = by_rank[2]
    assert (s2.state, s2.how) == ("running", "py-spy")
    assert "no handler for the stacks signal" in files[2]
    assert in_spin(place_of(files[2]))
    assert procs[2].poll() is None
    # What cannot be read says why, in its file and on its line.
    assert "is no process of this attempt" in by_rank[3].note and by_rank[3].note in files[3]
    assert by_rank[4].state == "on elsewhere" and "py-spy reads local pids only" in files[4]
    assert "never said hello" in by_rank[5].line() and "never said hello" in files[5]
    assert got.missing == [3, 4, 5]
    assert not list((attempt / "stacks").glob(".*"))  # no temp file left behind


def test_a_rank_on_another_host_is_asked_and_writes_its_own(tmp_path, procs):
    """The control channel's part, played by a callback: it signals the rank, which writes into
    the (shared) attempt dir; one that cannot be asked says why."""
    attempt = tmp_path / "attempts" / "000"
    procs.append(start(tmp_path, attempt, "handler", 0))
    ranks = {
        0: RankState(0, 0.0, 0.0, host="node-b", pid=procs[0].pid),
        1: RankState(1, 0.0, 0.0, host="node-b", pid=999999),
    }

    def ask(rank: int) -> str | None:
        if rank == 1:
            return "rank not connected to the control channel"
        os.kill(procs[0].pid, stack_files.STACKS_SIGNAL)
        return None

    got = asyncio.run(stacks.collect(attempt, ranks, 2, this_host="node-a", ask_remote=ask))
    s0, s1 = got.stacks
    assert (s0.state, s0.how) == ("on node-b", "signal") and in_spin(s0.place)
    assert s1.place is None and "could not be asked: rank not connected" in s1.note


def test_over_the_control_channel_a_rank_dumps_its_own_and_one_without_the_handler_lives(
    tmp_path, procs
):
    """The remote path for real: the supervisor's control socket, the ranks' beat threads."""
    attempt = tmp_path / "attempts" / "000"
    server = ControlServer(KEY, "job", "127.0.0.1", "127.0.0.1")
    try:
        procs += [start(tmp_path, attempt, "handler", 0, server.address),
                  start(tmp_path, attempt, "plain", 1, server.address)]  # fmt: skip

        def send(rank: int, signum: int) -> str | None:
            msg = control_msgs.control_message(
                "job", 0, rank, time.time(), "signal", 0, signal=signum
            )
            return server.send(0, rank, msg)

        deadline = time.monotonic() + READY_S
        while send(1, 0) is not None or send(0, 0) is not None:  # signal 0: are you there?
            assert time.monotonic() < deadline, "the ranks never connected"
            time.sleep(0.01)
        ranks = {r: RankState(r, 0.0, 0.0, host="node-b", pid=p.pid) for r, p in enumerate(procs)}
        ask = lambda rank: send(rank, int(stack_files.STACKS_SIGNAL))  # noqa: E731
        got = asyncio.run(
            stacks.collect(attempt, ranks, 2, this_host="node-a", ask_remote=ask, signal_wait_s=1)
        )
        s0, s1 = got.stacks
        assert (s0.state, s0.how) == ("on node-b", "signal") and in_spin(s0.place)
        assert "its own dump" in (attempt / "stacks" / "rank-0.txt").read_text()
        assert s1.place is None and "py-spy reads local pids only" in s1.note
        # Rank 1 has no handler: its beat thread did not pass the signal on (it would have
        # died of it), and it still takes the next command.
        assert send(1, int(signal.SIGUSR1)) is None
        ready, _, _ = select.select([procs[1].stdout], [], [], READY_S)
        assert ready and procs[1].stdout.readline() == "usr1\n"
        assert procs[1].poll() is None
    finally:
        server.close()


def test_without_the_supervisor_the_dump_goes_to_stderr(tmp_path, procs):
    proc = start(tmp_path, None, "handler", 0)
    procs.append(proc)
    os.kill(proc.pid, stack_files.STACKS_SIGNAL)
    err = b""
    while b"in <module>" not in err:  # the main thread's block ends the dump
        ready, _, _ = select.select([proc.stderr], [], [], READY_S)
        assert ready, err
        err += os.read(proc.stderr.fileno(), 65536)
    assert in_spin(place_of(err.decode()))
