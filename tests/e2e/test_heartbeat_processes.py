"""Heartbeats with a process: a rank dies with its parent; the beacon module imports no torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from contracts import env_names
from tests.support import beacon_env

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from worker.beat import Beacon
    b = Beacon.from_env(0, 1)
    b.hello("init")
    print(os.getpid(), flush=True)
    time.sleep(120)
    """
)
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
    time.sleep(120)
    """
)


@pytest.mark.timeout(60)
def test_rank_dies_with_its_parent(monkeypatch, tmp_path):
    """ES_EXIT_WITH_PARENT: a rank whose launcher was SIGKILLed does not train on alone."""
    beacon_env(monkeypatch, "tcp://127.0.0.1:9")
    monkeypatch.setenv(env_names.ENV_EXIT_WITH_PARENT, "1")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        child_pid = int(parent.stdout.readline())
        child = psutil.Process(child_pid)
        assert child.is_running()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, "the rank survived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_beat_module_does_not_import_torch():
    code = "import sys, worker.beat; sys.exit('torch' in sys.modules or 'zmq' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
