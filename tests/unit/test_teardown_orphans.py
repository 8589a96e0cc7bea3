"""What a teardown takes for its launch's orphans, and so ends and counts among its survivors
(supervisor/launch/processes.py): never a helper of the supervisor's being started beside it.

The node check's process is ours from its fork, but asyncio gives its pid an await later; a
standby ended in between (at a node loss, before the relaunch's node check) took it for its own
orphan: `standby_exit survivors=...` counted processes that were never the standby's.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from supervisor.launch.plan import LaunchPlan, ProcSpec
from supervisor.launch.processes import (
    CLOCK_SLACK_S,
    Launched,
    is_orphan,
    starting_helper,
)

LAUNCHED = 1000.0  # when the launch started (wall clock)


@pytest.mark.parametrize(
    ("created", "theirs", "helper_since", "orphan"),
    [
        (LAUNCHED + 5, False, None, True),  # started after the launch, no one else's
        (LAUNCHED - CLOCK_SLACK_S - 1, False, None, False),  # older than the launch
        (LAUNCHED - 0.5, False, None, True),  # within the clocks' slack: may be the launch's
        (LAUNCHED + 5, True, None, False),  # in another launch's tree, or a helper's
        (LAUNCHED + 5, False, LAUNCHED + 4.5, False),  # started while a helper was starting
        (LAUNCHED + 5, False, LAUNCHED + 10, True),  # before the helper's start began
    ],
)
def test_which_child_of_ours_is_the_launch_s_orphan(created, theirs, helper_since, orphan):
    assert is_orphan(created, LAUNCHED, theirs, helper_since) is orphan


WAITS = "import time; time.sleep(60)"


def _plan() -> LaunchPlan:
    return LaunchPlan("local", [ProcSpec([sys.executable, "-c", WAITS], {}, "n0")], 1, ["n0"])


def test_a_teardown_beside_a_helper_s_start_leaves_it_alone_and_uncounted(tmp_path):
    """A helper started after the launch and not yet held by its pid: before, the teardown
    SIGTERMed it and counted it a survivor."""

    async def scenario(starting: bool) -> tuple[list[int], int | None]:
        run = await Launched.start(_plan(), tmp_path / f"{starting}.log")
        await asyncio.sleep(0.05)
        helper = subprocess.Popen([sys.executable, "-c", WAITS], start_new_session=True)
        try:
            if starting:
                with starting_helper():
                    result = await run.teardown(0.2)
            else:
                result = await run.teardown(0.2)
            return [p for p in result.survivors if p == helper.pid], helper.poll()
        finally:
            helper.kill()
            helper.wait()

    counted, helper_rc = asyncio.run(scenario(starting=True))
    assert counted == [] and helper_rc is None  # it ran on, and was not counted
    # Without the mark, the same helper is an orphan: ended (SIGTERM) by the teardown.
    _, helper_rc = asyncio.run(scenario(starting=False))
    assert helper_rc is not None
