"""Issue 25 item 3 in-process: the signals that stop a job, and a console that vanished (a closed
terminal: EIO; a reader gone: EPIPE) never failing a write."""

from __future__ import annotations

import os
import signal

import pytest

from supervisor.log.console import Guarded
from supervisor.run.stop import stop_signals


def on_dev_null(fd: int) -> bool:
    return os.path.samestat(os.fstat(fd), os.stat(os.devnull))


@pytest.mark.parametrize("how", ["closed terminal", "reader gone"])
def test_a_console_that_vanished_never_fails_a_write(how):
    if how == "closed terminal":
        other, fd = os.openpty()  # the terminal's side closes: writes to ours fail with EIO
    else:
        other, fd = os.pipe()  # the reader goes: EPIPE (Python ignores SIGPIPE)
    os.close(other)
    stream = open(fd, "w", buffering=1)  # noqa: SIM115 - closed below
    out = Guarded(stream)
    try:
        assert out.write("start  info  one event\n") == 23  # line-buffered: written at once
        out.write("x" * 100_000)
        out.flush()
        assert out.gone is not None and on_dev_null(fd)
        assert out.write("and the next\n") == 13
        out.flush()
        print("the report", file=out, flush=True)  # what cli and report_cli do
        assert out.fileno() == fd and not out.isatty()
    finally:
        stream.close()


def test_a_console_that_works_is_left_alone():
    r, w = os.pipe()
    stream = open(w, "w")  # noqa: SIM115 - closed below
    out = Guarded(stream)
    out.write("hello\n")
    out.flush()
    assert out.gone is None and os.read(r, 100) == b"hello\n"
    stream.close()
    os.close(r)


def test_sighup_stops_the_job_unless_it_is_ignored_as_under_nohup():
    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM)
    finally:
        signal.signal(signal.SIGHUP, before)
