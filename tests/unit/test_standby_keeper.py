"""The standby keeper's hand-over at a failure: a standby that cannot be used never holds up the
cold launch (its ranks stopped at once, its end after); one well along its start is waited
for."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil

from supervisor.run.standby import StandbyKeeper

TEARDOWN_S = 0.5  # a slow standby teardown: the hand-over must not wait for it


class FakeStandby:
    def __init__(self, number: int, launched_ago_s: float) -> None:
        self.number = number
        self.rank_pids: list[int] = []  # its one rank's process, once started
        self.running = SimpleNamespace(
            plan=SimpleNamespace(nodes=["n0"]), worker_pids=lambda: self.rank_pids
        )
        self.nodes = ["n0"]
        self.table = SimpleNamespace(launched_at=time.monotonic() - launched_ago_s, world=1)
        self.ready_at: float | None = None
        self.ended: list[tuple[str, float]] = []

    async def end_standby(self, reason: str, stopped: bool = False) -> None:
        await asyncio.sleep(TEARDOWN_S)
        self.ended.append((reason, time.monotonic()))


def keeper(standby: FakeStandby, prepare_s: float | None = None) -> tuple[StandbyKeeper, list]:
    unrouted: list = []
    launch = SimpleNamespace(emulate_nodes=True)  # every rank on this host
    resolved = SimpleNamespace(cfg=SimpleNamespace(launch=launch), template_off="no templates")
    job = SimpleNamespace(resolved=resolved)
    k = StandbyKeeper(job, lambda: 9, lambda a: None, unrouted.append)  # type: ignore[arg-type]
    k.attempt, k.prepare_s = standby, prepare_s  # type: ignore[assignment]
    return k, unrouted


def test_an_unready_standby_is_dropped_without_holding_up_the_cold_launch():
    async def main() -> None:
        standby = FakeStandby(3, launched_ago_s=0.1)
        k, unrouted = keeper(standby, prepare_s=10.0)
        t0 = time.monotonic()
        got, why = await k.take()
        taken = time.monotonic()
        assert got is None and why == "the standby was not ready"
        assert taken - t0 < TEARDOWN_S / 2 and not standby.ended  # its end runs beside
        await k.close("job over", for_good=True)  # ... and the job's end waits for it
        assert [r for r, _ in standby.ended] == ["unusable"] and unrouted == [standby]
        assert standby.ended[0][1] - t0 >= TEARDOWN_S

    asyncio.run(main())


def test_a_dropped_standby_s_ranks_are_stopped_at_once_and_ended_once_the_cold_attempt_steps():
    """Its teardown would take the cores the cold attempt's start needs: its ranks (a real
    process here) are SIGSTOPped at the take, and it is ended at the cold attempt's first
    step (`ensure`)."""

    async def main() -> None:
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            standby = FakeStandby(3, launched_ago_s=0.1)
            standby.rank_pids = [rank.pid]
            k, _ = keeper(standby, prepare_s=10.0)
            k.given_up = True  # no next standby here: only the dropped one's end
            got, _ = await k.take()
            assert got is None and k.dropped is standby
            # the signal is sent; the kernel stops the process a moment later on a busy host
            for _ in range(100):
                if psutil.Process(rank.pid).status() == psutil.STATUS_STOPPED:
                    break
                await asyncio.sleep(0.01)
            assert psutil.Process(rank.pid).status() == psutil.STATUS_STOPPED
            await asyncio.sleep(TEARDOWN_S * 2)
            assert not standby.ended  # stopped, not ended, while the cold attempt starts
            k.ensure()  # the cold attempt's first step
            assert k.dropped is None
            # A wait for it that is cancelled (the keeper's task, at the next take) leaves
            # the teardown running, and the job's end still waits for it.
            waiter = asyncio.get_running_loop().create_task(k._ended())
            await asyncio.sleep(0.01)
            waiter.cancel()
            t0 = time.monotonic()
            await k.close("job over", for_good=True)
            assert [r for r, _ in standby.ended] == ["unusable"]
            assert standby.ended[0][1] - t0 >= TEARDOWN_S * 0.8
        finally:
            rank.kill()
            rank.wait()

    asyncio.run(main())


def test_a_standby_well_along_its_start_is_waited_for_and_used():
    async def main() -> None:
        standby = FakeStandby(3, launched_ago_s=9.0)
        k, _ = keeper(standby, prepare_s=9.3)
        k._task = asyncio.get_running_loop().create_task(asyncio.sleep(60))  # its watch

        async def ready_soon() -> None:
            await asyncio.sleep(0.2)
            standby.ready_at = time.monotonic()

        asyncio.get_running_loop().create_task(ready_soon())
        got, why = await k.take()
        assert got is standby and why is None and 0.15 < k.waited_s < 1.0
        assert k.prepare_s is not None and k.prepare_s > 9.0 and not standby.ended

    asyncio.run(main())


def test_a_waited_for_standby_that_stays_unready_is_dropped_at_the_bound():
    async def main() -> None:
        standby = FakeStandby(3, launched_ago_s=9.0)
        k, _ = keeper(standby, prepare_s=9.3)  # a wait of at most 0.3 + 0.5 s
        k._task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        got, why = await k.take()
        assert got is None and why == "the standby was not ready" and 0.7 < k.waited_s < 1.5
        await k.close("job over", for_good=True)
        assert [r for r, _ in standby.ended] == ["unusable"]

    asyncio.run(main())


def test_a_standby_lost_with_a_failed_node_is_named_at_the_relaunch():
    """A node loss kills the standby's ranks there: the keeper sees it lost before the relaunch
    asks, and the cold relaunch still says why (not merely that none runs)."""

    async def main() -> None:
        k, _ = keeper(FakeStandby(3, launched_ago_s=5.0))
        k.attempt, k.lost_nodes = None, ["n0", "n1"]
        got, why = await k.take(["n1"])
        assert got is None and why.startswith("the standby ended with the failed node n1: ")
        assert k.lost_nodes == []  # said once: the next standby is another
        assert (await k.take(["n1"]))[1] == "no standby running"

    asyncio.run(main())


def test_the_next_standby_counts_the_newest_step_of_any_earlier_attempt():
    """An attempt that failed before it stepped knows no step: the one before it does."""
    k, _ = keeper(FakeStandby(3, launched_ago_s=0.1))

    def ran(max_step):
        return SimpleNamespace(table=SimpleNamespace(max_step=max_step))

    assert k.starter(None, None).newest_before is None  # the job's first attempt
    assert k.starter(ran(12), None).newest_before == 12
    assert k.starter(ran(None), None).newest_before == 12  # failed during its start
    assert k.starter(ran(9), None).newest_before == 12
