"""Fork templates ([restart] template): one per node and spare, kept for the whole job.

Each is `python -m worker.template`, a launch of its own on its node (a lost node ends only its
own), that imports torch and the training loop once and then forks every rank the job starts on
that node: the launcher starts `worker.template_client` in each rank's place, and the client
has the template fork the rank (or starts it cold when no template answers). So a new standby,
prepared rank or cold start costs a fork, not an interpreter and its imports. A template that
ends is reported (`template_lost`) and started again after a pause, unless its node is down; one
on a node a `node_loss` took is ended with the node. The job's end ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from contracts import env_names, template_msgs
from supervisor.launch.processes import Launched
from supervisor.policy import exits
from supervisor.run.context import JobContext

RESTART_AFTER_S = 1.0  # a template that ended is started again after this (its node still up)
MAX_LOST_IN_A_ROW = 5  # then the node's ranks start cold for the rest of the job
STEADY_S = 60.0  # a template that ran this long before it ended starts the count anew
# At the job's end a template's SIGTERM ends it at once, its launcher with it (a SIGKILL would
# leave Hydra's "BAD TERMINATION" in templates/output-NODE.log at every job's end).
END_GRACE_S = 2.0


def lost_in_a_row(before: int, ran_s: float) -> int:
    """Pure: the node's templates lost in a row once one more ended after `ran_s` seconds (one
    that ran a while is not part of a row: a few losses over a long job never end its forks)."""
    return 1 if ran_s >= STEADY_S else before + 1


class Templates:
    """Keeps a fork template running on each node and spare of the job."""

    def __init__(self, job: JobContext) -> None:
        self.job = job
        self.launches: dict[str, Launched] = {}
        self.lost: dict[str, int] = {}  # node -> templates lost in a row there
        self.ready: set[str] = set()  # nodes whose template said it serves
        self._watches: set[asyncio.Future] = set()
        self.over = False

    @classmethod
    async def start_for(cls, job: JobContext) -> Templates | None:
        """The job's templates, started; None where the job keeps none."""
        if job.resolved.template_off is not None:
            return None
        templates = cls(job)
        await templates.start()
        return templates

    @property
    def folder(self) -> Path:
        return self.job.resolved.run_dir / "templates"

    def env(self) -> dict[str, str]:
        """What a template needs of the job: its id and key (it serves only this job's clients)
        and to die with its launcher; the ranks' `base_env`, which the imports may read and
        the C library reads at the start (a forked rank keeps its template's malloc)."""
        return {
            **self.job.base_env(),
            env_names.ENV_JOB_ID: self.job.job_id,
            env_names.ENV_HEARTBEAT_KEY: self.job.key,
            env_names.ENV_EXIT_WITH_PARENT: "1",
        }

    async def start(self) -> None:
        """A template on every node and spare that is up and has none."""
        resolved = self.job.resolved
        down = self.job.faults.nodes_down()
        nodes = [n for n in [*resolved.pool.active, *resolved.pool.spares] if n not in down]
        started = []
        for node in nodes:
            if node not in self.launches and self.lost.get(node, 0) < MAX_LOST_IN_A_ROW:
                if await self._start_one(node):
                    started.append(node)
        if started:
            self.job.emit("template_launch", nodes=started)

    def starting_nodes(self) -> set[str]:
        """The nodes whose template is still importing (it has not said `READY_LINE`)."""
        out = set()
        for node, run in self.launches.items():
            if node in self.ready:
                continue
            if any(template_msgs.READY_LINE in line for line in tuple(run.tail)):  # pumps append
                self.ready.add(node)
            elif not run.exits:
                out.add(node)
        return out

    async def _start_one(self, node: str) -> bool:
        self.ready.discard(node)
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
        plan = self.job.resolved.template_plan(self.env(), node)
        with contextlib.suppress(OSError):
            (self.folder / f"command-{node}.txt").write_text(plan.text())
        cwd = self.job.resolved.cfg.launch.cwd or None
        try:
            run = await self.job.launcher.start(plan, self.folder / f"output-{node}.log", cwd, None)
        except OSError as exc:
            self.job.emit("template_lost", node=node, reason=f"cannot start: {exc}")
            return False
        self.launches[node] = run
        watch = asyncio.ensure_future(self._watch(node, run))
        self._watches.add(watch)
        watch.add_done_callback(self._watches.discard)
        return True

    async def _watch(self, node: str, run: Launched) -> None:
        ended = await run.wait()
        if self.launches.get(node) is not run or self.over:
            return
        del self.launches[node]
        ran = ended.mono - run.started
        self.lost[node] = lost_in_a_row(self.lost.get(node, 0), ran)
        self.job.emit(
            "template_lost", node=node, lost=self.lost[node],
            reason=f"its launch ended ({exits.describe_returncode(ended.returncode)})",
        )  # fmt: skip
        await run.teardown(0.0)
        await asyncio.sleep(RESTART_AFTER_S)
        if not self.over and node not in self.job.faults.nodes_down():
            await self.start()

    async def drop_down(self) -> None:
        """End the templates of nodes a `node_loss` took (a lost node's processes are gone)."""
        for node in self.job.faults.nodes_down():
            run = self.launches.pop(node, None)
            if run is not None:
                result = await run.teardown(0.0)
                self.job.emit("template_exit", node=node, reason="node down",
                              survivors=len(result.survivors))  # fmt: skip

    async def close(self) -> None:
        """End every template; keep none from now on."""
        self.over = True
        for watch in list(self._watches):
            watch.cancel()
        launches, self.launches = self.launches, {}
        for node, run in launches.items():
            result = await run.teardown(END_GRACE_S)
            self.job.emit("template_exit", node=node, reason="job over",
                          survivors=len(result.survivors))  # fmt: skip
