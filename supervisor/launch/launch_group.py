"""Several launches run as one attempt: the prepared ranks of each node ([restart] warm_spare)
are a launch of their own, so that a lost node ends only its own, and the attempt that takes
them over watches, stops and tears down the nodes' launches together, as it would one launch."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from supervisor.launch.plan import LaunchPlan
from supervisor.launch.processes import Exit, Launched, TeardownResult


class LaunchGroup:
    """The launches of an attempt's nodes, with one launch's interface (`context.Running`)."""

    def __init__(self, launches: Sequence[Launched], started: float) -> None:
        self.launches = list(launches)
        first = self.launches[0].plan
        self.plan = LaunchPlan(
            first.flavor,
            [spec for run in self.launches for spec in run.plan.procs],
            sum(run.plan.world for run in self.launches),
            [node for run in self.launches for node in run.plan.nodes],
            first.stop_signal,
        )
        self.started = started  # monotonic: when the attempt took them over

    @property
    def tail(self) -> list[str]:
        """The newest lines of every node's launch (each keeps its own, in order)."""
        return list(itertools.chain.from_iterable(run.tail for run in self.launches))

    @property
    def pids(self) -> list[int]:
        return [pid for run in self.launches for pid in run.pids]

    async def wait(self) -> Exit:
        """The first failing exit of any launch (the attempt is over, as when one launcher's
        rank fails), or 0 once every launch ended cleanly."""
        pending = {asyncio.ensure_future(run.wait()) for run in self.launches}
        last: Exit | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    last = task.result()
                    if last.returncode != 0:
                        return last
        finally:
            for task in pending:
                task.cancel()
        assert last is not None
        return last

    def refresh(self, extra: list[int] = ()) -> None:
        for run in self.launches:
            run.refresh(list(extra))

    def signal_stop(self) -> None:
        for run in self.launches:
            run.signal_stop()

    def worker_pids(self) -> list[int]:
        return [pid for run in self.launches for pid in run.worker_pids()]

    async def teardown(self, grace: float, extra: list[int] = ()) -> TeardownResult:
        """Every node's launch at once (each with `grace`)."""
        results = await asyncio.gather(*(run.teardown(grace, list(extra)) for run in self.launches))
        return TeardownResult(
            sum(r.terminated for r in results),
            sum(r.killed for r in results),
            [pid for r in results for pid in r.survivors],
            max(r.seconds for r in results),
        )

    async def output_read(self, timeout: float) -> None:
        await asyncio.gather(*(run.output_read(timeout) for run in self.launches))
