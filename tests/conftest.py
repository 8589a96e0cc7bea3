"""Fixtures shared by unit/ and e2e/ (plain helpers are in support.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import rec, synthetic_events, synthetic_metrics, write_run


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", synthetic_events(), synthetic_metrics())


@pytest.fixture
def baseline_dir(tmp_path: Path) -> Path:
    events = [
        {"event": "start", "ts": 2000.0, "mono": 500.0},
        {"event": "launch", "ts": 2000.0, "mono": 500.0, "attempt": 0},
        {"event": "first_step", "ts": 2009.0, "mono": 509.0, "attempt": 0, "step": 1},
        {"event": "done", "ts": 2059.0, "mono": 559.0, "attempt": 0, "step": 50},
        {"event": "supervisor_exit", "ts": 2060.0, "mono": 560.0, "code": 0, "code_name": "DONE"},
    ]
    metrics = {0: [{**rec(k, 2008.0 + k)} for k in range(1, 51)]}
    return write_run(tmp_path / "base", events, metrics, "[worker]\nsave_interval = 0\n")
