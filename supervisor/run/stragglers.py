"""An attempt's stragglers: scored as its ranks report, said in `straggler` events, and with
`[stragglers] action = "replace"` a replacement set up for the next durable checkpoint.

The score and the response are pure (supervisor.policy.stragglers); this feeds them (with the
nodes where the job's own standby, prepared ranks or a fork template are starting: not judged
meanwhile), emits, and sets `replace_due` once the checkpoint after a finding is complete: the
attempt then stops its ranks gracefully and the job relaunches without the slow node
(supervisor.run.job).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from contracts.exit_codes import ExitCode
from supervisor.policy import stragglers
from supervisor.policy.restarts import Decision
from supervisor.policy.stragglers import StragglerFinding
from supervisor.settings import checks
from supervisor.settings.config import Config
from supervisor.watch.step_times import StepTimes

# A node's start is taken to slow its ranks' steps for this many heartbeat intervals after it
# ended: a step computed during it may be said a beat later.
SETTLE_BEATS = 3


class StragglerWatch:
    """One attempt's straggler score; `replacing`: the finding whose node is to go, once
    `replace_due` is set."""

    def __init__(
        self,
        cfg: Config,
        world: int,
        nodes: Sequence[str],
        spares: Callable[[], int],
        emit: Callable[..., None],
        restarts_left: Callable[[], int] = lambda: 1,
        starting: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        st = cfg.stragglers
        self.cfg = cfg
        self.on = st.enabled
        self.times = StepTimes(world)
        self.score = stragglers.StragglerScore(st.threshold, st.window)
        self.starting = starting  # the nodes where the job's own processes start now
        self.busy = stragglers.StartingNodes(SETTLE_BEATS * cfg.heartbeat.interval_s)
        self.nodes = list(nodes)
        self.spares = spares
        self.restarts_left = restarts_left
        self.checkpoints = st.action != "replace" or not checks.no_durable_checkpoints(cfg)
        self.emit = emit
        self.replacing: StragglerFinding | None = None
        self.replace_due = asyncio.Event()
        last = cfg.worker.flags.get("train_iters")
        self.last_step = last if isinstance(last, int) and not isinstance(last, bool) else None

    def node_of(self, rank: int) -> str:
        per = self.cfg.launch.ranks_per_node
        index = rank // per
        return self.nodes[index] if index < len(self.nodes) else f"rank {rank}'s node"

    def on_message(self, msg: dict[str, Any]) -> None:
        if self.on:
            self.times.take(msg)

    def check(self, ckpt_complete: int | None, now: float | None = None) -> None:
        """At each quiet check: score the new observations (not those of a node where the
        job's own processes were starting), say what they found; set `replace_due` once a
        durable checkpoint newer than the pending finding's step is complete, unless it is the
        job's last step (nothing is left to run on the spare)."""
        if not self.on:
            return
        now = time.monotonic() if now is None else now
        self.busy.note(self.starting(), self.times.newest, now)
        for step, computes in self.times.observations():
            busy = self.busy.busy_at(step)
            for finding in self.score.observe(step, computes, self.node_of, busy):
                self._found(finding)
        pending = self.replacing
        if pending is not None and stragglers.replace_now(
            pending.step, ckpt_complete, self.last_step
        ):
            self.replace_due.set()

    def _found(self, finding: StragglerFinding) -> None:
        restart = self.cfg.restart
        response = stragglers.respond(
            self.cfg.stragglers.action,
            self.spares(),
            restart.shrink,
            len(self.nodes),
            restart.min_nodes,
            pending=self.replacing is not None,
            restarts_left=self.restarts_left(),
            checkpoints=self.checkpoints,
        )
        if response.replace:
            self.replacing = finding
        action = "replace" if response.replace else "report"
        self.emit("straggler", **finding.fields(), action=action, done=response.said)


async def replace(result: Any, job: Any) -> Any:
    """An attempt stopped to leave a straggler's node (`result.replace`): that node out (a
    spare in its place, or shrink: the job's NodeKeeper), then the job's relaunch. Returns the
    next attempt, or (exit code, why) once the job said in `give_up` why it ends."""
    found: StragglerFinding = result.replace
    ranks = ", ".join(str(r) for r in found.ranks)
    why = f"straggler: rank(s) {ranks} scored {found.score:.2f} at step {found.step}"
    stop = job.nodes.drop_straggler(found.node, why, result.number)
    if stop is None:
        reason = f"straggler on {found.node} replaced ({why})"
        attempt = await job.relaunch(result.number, Decision("relaunch", ExitCode.DONE, reason))
        if attempt is not None:
            return attempt
    code, why = (ExitCode.INTERRUPTED, "interrupted") if stop is None else (ExitCode.NODES, stop)
    job.give_up(result.number, code, why, nodes=job.resolved.pool.as_dict())
    return code, why
