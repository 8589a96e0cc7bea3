"""What a job holds and leaves on this node: the memory tier's directory (held for the job's
life, removed however it ends), its async stage dir, and what killed runs left that nothing
holds any more (swept at the job's start and end)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from supervisor.host import hygiene, memdir
from supervisor.settings.config import Config

SWEEP_NAMED = 50  # paths a node_sweep event names (it counts them all)


class NodeScratch:
    """Opened before the first launch, closed when the job is over (`emit`: the job's)."""

    def __init__(self, cfg: Config, job_id: str, emit: Callable[..., None]) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.emit = emit
        # The memory tier's directories (one per emulated node), held for the job.
        self.mem: list[memdir.Held] = []

    def open(self) -> None:
        """Before the first launch: the memory tier's directory, then the sweep."""
        self._open_memory_tier()
        self._sweep("start")

    def close(self) -> None:
        """The job is over: its memory directory goes first (whatever fails after, the node's
        memory is freed), then its async stage dir, then whatever its attempts left."""
        self._close_memory_tier()
        env = {**os.environ, **self.cfg.launch.env}
        stage = hygiene.stage_dir(self.cfg.worker.flags, env, self.job_id)
        if stage is not None and os.path.lexists(stage):
            error = hygiene.remove_stage_dir(stage)
            if error is None:
                self.emit("stage_removed", path=stage)
            else:
                self.emit("stage_remove_failed", path=stage, error=error)
        self._sweep("end")

    def _open_memory_tier(self) -> None:
        """Hold the job's own memory directory when its ranks keep one (first: a job continued
        after its supervisor was killed takes up the copies it left), then remove what dead
        jobs left in this node's memory root."""
        launch = self.cfg.launch
        emulated = list(launch.nodes) if launch.emulate_nodes and launch.nodes else None
        for root in memdir.roots(launch.env, emulated):
            if memdir.wanted(self.cfg.worker.flags):
                self.mem.append(memdir.hold(root, self.job_id))
                self.emit("mem_held", path=self.mem[-1].path)
            swept = memdir.sweep_abandoned(root)
            if swept:
                self.emit("mem_sweep", root=root, paths=swept)

    def _close_memory_tier(self) -> None:
        """Its memory directories go (no attempt will resume from them)."""
        held, self.mem = self.mem, []
        for one in held:
            error = memdir.remove(one)
            if error is None:
                self.emit("mem_removed", path=one.path)
            else:
                self.emit("mem_remove_failed", path=one.path, error=error)
        launch = self.cfg.launch
        if launch.emulate_nodes and launch.nodes:  # each emulated node's own root, once empty
            base = memdir.root(launch.env)
            for root in memdir.roots(launch.env, list(launch.nodes)):
                if root != base:
                    with contextlib.suppress(OSError):
                        os.rmdir(root)

    def _sweep(self, when: str) -> None:
        """What killed runs left on this node and nothing holds any more (`hygiene.sweep`)."""
        removed = hygiene.sweep()
        if removed:  # after a day of runs from before the fix: hundreds
            self.emit("node_sweep", when=when, count=len(removed), paths=removed[:SWEEP_NAMED])
