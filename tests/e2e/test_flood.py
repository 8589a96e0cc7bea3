"""A heartbeat flood cannot exhaust the supervisor: its memory stays bounded, it still finds a
hang, and the log gets a few `bad_messages` events, not one every check."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_flood_of_junk_frames_keeps_memory_bounded_and_hangs_found():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ES_")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "flood.py"), "--seconds", "6"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["frames_sent"] > 1000  # it was a flood
    assert sum(result["dropped"].values()) > 1000
    assert result["peak_ratio"] < 2.0 and result["after_ratio"] < 1.5, result
    assert result["bad_messages_events"] <= 4  # one every 5 s at most, over ~12 s
    assert result["hang_latency_s"] is not None  # the hang was still found
