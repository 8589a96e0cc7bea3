"""The real process handling: exit detection, teardown, no orphans, hydra's output lines."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from supervisor.launch.plan import LaunchPlan, ProcSpec
from supervisor.launch.processes import Launched

# --- real processes -------------------------------------------------------------------------------
STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A grandchild in its own session: only the pid snapshot and the subreaper can find it.
    subprocess.Popen([sys.executable, "-c",
                      "import os,signal,time; os.setsid(); "
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    print("ready", flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]))
    """
)


def plan_of(*procs: list[str]) -> LaunchPlan:
    specs = [ProcSpec(argv, {}, label=f"[{i}] ", rank=i) for i, argv in enumerate(procs)]
    return LaunchPlan("local", specs, len(specs), ["h"])


@pytest.mark.timeout(60)
def test_exit_is_seen_at_once_and_teardown_leaves_nothing(tmp_path: Path):
    async def main():
        plan = plan_of(
            [sys.executable, "-c", STUBBORN, "2.0", "3"],
            [sys.executable, "-c", STUBBORN, "300", "0"],
        )
        log = tmp_path / "out.log"
        launched = await Launched.start(plan, log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # both ranks have started their grandchild
            text = log.read_text() if log.exists() else ""
            if "[0] ready" in text and "[1] ready" in text:
                break
            await asyncio.sleep(0.05)
        launched.refresh()
        known = list(launched._known.values())
        ex = await asyncio.wait_for(launched.wait(), 20)
        seen = time.monotonic()
        result = await launched.teardown(grace=0.5)
        return ex, seen, result, known

    ex, seen, result, known = asyncio.run(main())
    assert len(known) == 4  # two ranks, two grandchildren
    assert not [p for p in known if p.is_running() and p.status() != "zombie"]
    assert ex.returncode == 3 and ex.rank == 0
    assert seen - ex.mono < 0.2, "the exit was noticed late"
    assert result.survivors == [] and result.killed >= 2
    leftovers = [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]
    assert leftovers == []
    log = (tmp_path / "out.log").read_text()
    assert "[0] ready" in log and "[1] ready" in log


@pytest.mark.slow
def test_output_log_has_one_rank_prefix_a_line_under_hydra(tmp_path: Path):
    from tests.support import mpiexec

    script = (
        "import os, sys, time\n"
        "for i in range(20):\n"
        "    os.write(2, b'ZeroDivisionError'); time.sleep(0.002); os.write(2, b': half\\n')\n"
    )
    argv = [mpiexec(), "-n", "2", "-prepend-rank", sys.executable, "-c", script]
    plan = LaunchPlan("hydra", [ProcSpec(argv, {})], 2, ["localhost"])
    out = tmp_path / "output.log"

    async def main():
        launched = await Launched.start(plan, out)
        await asyncio.wait_for(launched.wait(), 60)
        await launched.output_read(10.0)  # every line the ranks wrote is in the log
        await launched.teardown(1.0)

    asyncio.run(main())
    lines = out.read_text().splitlines()
    assert len(lines) == 40, lines
    assert all(line in ("[0] ZeroDivisionError: half", "[1] ZeroDivisionError: half")
               for line in lines), lines  # fmt: skip
