"""worker.priority: a thread at nice 19 alone, and a process's autogroup lowered for a block and
given its nice back (the real kernel interface, in a child of a session of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from tests.support import REPO
from worker import priority


def test_the_calling_thread_alone_runs_at_the_lowest_priority():
    seen = {}

    def look():
        priority.lowest_priority()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=look)
    t.start()
    t.join()
    assert seen["nice"] == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # that thread only


@pytest.mark.parametrize(
    ("text", "nice"),
    [("/autogroup-42 nice 0\n", 0), ("/autogroup-7 nice 19", 19), ("/autogroup-7 nice -5", -5),
     ("", None), ("/autogroup-7 nice x", None), ("nice 0", None)],
)  # fmt: skip
def test_an_autogroup_line_is_read(text, nice):
    assert priority.autogroup_nice(text) == nice


CHILD = """
from pathlib import Path
from worker import priority
read = lambda: priority.autogroup_nice(Path("/proc/self/autogroup").read_text())
before = read()
with priority.lowest_session():
    inside = read()
print(before, inside, read())
"""


@pytest.mark.skipif(not priority.AUTOGROUP.exists(), reason="no autogroups in this kernel")
def test_a_session_is_lowered_for_the_block_and_gets_its_nice_back():
    got = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True,
                         timeout=60, start_new_session=True)  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["0", "19", "0"]
