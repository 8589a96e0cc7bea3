"""The job's node pool as failures change it.

Failures laid on a node are counted; a node at `exclude_after`, or one that fails the node check
(before the first launch, and again before a relaunch once a node is known lost), is out: a
spare takes its place, else the job shrinks onto the nodes left (the worker flags that world
needs, the fault schedule told), else it stops. What to do is `nodes.exclude`'s (pure); the
keeper acts on it and says so in events.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Callable

from supervisor.host import node_check
from supervisor.launch import hosts
from supervisor.launch.resolve import Resolved
from supervisor.policy import nodes
from supervisor.run.fault_hooks import FaultHooks

NODE_CHECK_TIMEOUT_S = 60.0  # the pre-launch check of every node, all together
RECHECK_TRIES = 2  # the check before a relaunch, when no node answered (the launcher failed)


class NodeKeeper:
    """Changes `resolved.pool` (and the host file, and the worker flags of a smaller world) as
    nodes are excluded. Each method returns why the job must stop, or None."""

    def __init__(self, resolved: Resolved, emit: Callable[..., None], faults: FaultHooks) -> None:
        self.resolved = resolved
        self.cfg = resolved.cfg
        self.emit = emit
        self.faults = faults
        self.failures: collections.Counter[str] = collections.Counter()  # node -> laid on it
        self.just_excluded: list[str] = []  # by the last attempt's failure: no standby there
        faults.set_nodes(resolved.pool.active)

    async def check(self) -> str | None:
        """Before the first launch of a job of several nodes: one quick process per node
        (`supervisor.host.node_check`) through the job's launcher; a node where none could start,
        or whose directories the ranks could not write, is out before it costs an attempt."""
        return await self._check_nodes("pre-launch check", None, tries=1)

    async def recheck(
        self, attempt: int, silent_node: str | None = None, seen: str = ""
    ) -> str | None:
        """After attempt `attempt` failed, before the relaunch: when a node is known lost (a
        `node_loss` fault), or the failure is laid on a host whose ranks went silent
        (`silent_node`), check the nodes again; a lost one does not answer and is out at once,
        a spare in its place, whatever its failure count. A check that no node answered (the
        launcher failed) is tried again, RECHECK_TRIES in all. A silent host that fails it is out
        of reach (cut off, or dead): said in a `node_unreachable` event with what was `seen`."""
        if silent_node is not None and (
            self.cfg.launch.emulate_nodes or hosts.is_this_host(silent_node)
        ):
            silent_node = None  # this host: alive, as the supervisor is
        down = self.faults.nodes_down()
        if not nodes.recheck_before_relaunch(down, self.resolved.pool, silent_node):
            return None
        unreachable = {silent_node: seen} if silent_node is not None else {}
        return await self._check_nodes(
            "node check before relaunch", attempt, RECHECK_TRIES, unreachable
        )

    async def _check_nodes(
        self, what: str, attempt: int | None, tries: int, silent: dict[str, str] | None = None
    ) -> str | None:
        resolved = self.resolved
        if len(resolved.nodes) < 2 or resolved.kind.this_host_only:
            return None
        for _ in range(tries):
            result = await self._run_check()
            if result.reported:
                break
        if not result.failed:
            return None
        for node, seen in (silent or {}).items():
            if node in result.failed:
                at = {} if attempt is None else {"attempt": attempt}
                self.emit("node_unreachable", node=node, seen=seen, check=result.failed[node], **at)
        reasons = {n: f"{what}: {why}" for n, why in result.failed.items()}
        return self._exclude(reasons, attempt)

    async def _run_check(self) -> node_check.CheckResult:
        """One check of every node, active and spare, said in a `node_check` event."""
        resolved = self.resolved
        every = list(resolved.pool.active) + list(resolved.pool.spares)
        env = {**os.environ, **self.cfg.launch.env}
        dirs = node_check.dirs_to_check(self.cfg.worker.flags, env)
        started = asyncio.get_running_loop().time()
        down = self.faults.nodes_down()
        lines = await node_check.run_on(resolved, every, dirs, NODE_CHECK_TIMEOUT_S, down)
        result = node_check.judge(lines, every)
        silent = result.silent() if result.reported else list(every)
        if silent and len(every) > 1 and not self.cfg.launch.emulate_nodes:
            # one host that does not answer fails a launch over ssh for all, the others' reports
            # cut short by it: each silent one alone
            lines = await node_check.run_on(
                resolved, silent, dirs, NODE_CHECK_TIMEOUT_S, down, each=True
            )
            result = node_check.merge(result, node_check.judge(lines, silent), silent)
        seconds = asyncio.get_running_loop().time() - started
        self.emit(
            "node_check",
            nodes=every,
            dirs=dirs,
            reported=result.reported,
            failed=result.failed,
            seconds=round(seconds, 3),
        )
        return result

    def count_failure(self, blame: nodes.Attribution | None, attempt: int) -> str | None:
        """Count attempt `attempt`'s failure against the node it is laid on (`blame`); a node at
        `exclude_after` is out."""
        self.just_excluded = []
        if blame is None or blame.node is None:
            return None
        self.failures[blame.node] += 1
        restart = self.cfg.restart
        out = nodes.excluded_now(self.failures, restart.exclude_after, self.resolved.pool)
        reasons = {
            name: f"{self.failures[name]} failure(s) laid on it "
            f"(exclude_after = {restart.exclude_after}): {blame.why}"
            for name in out
        }
        return self._exclude(reasons, attempt) if out else None

    def drop_straggler(self, node: str, why: str, attempt: int) -> str | None:
        """A straggler's node is out (`[stragglers] action = "replace"`), whatever its failure
        count: a spare takes its place, else the job shrinks."""
        self.just_excluded = []
        return self._exclude({node: why}, attempt)

    def _exclude(self, reasons: dict[str, str], attempt: int | None) -> str | None:
        """Take the nodes of `reasons` out: a spare takes each place, else the job shrinks
        (`nodes.exclude`)."""
        restart, resolved = self.cfg.restart, self.resolved
        at = {} if attempt is None else {"attempt": attempt}
        for name, why in reasons.items():
            count = self.failures[name]
            self.emit("node_excluded", node=name, reason=why, count=count, **at)
        change = nodes.exclude(resolved.pool, list(reasons), restart.shrink, restart.min_nodes)
        self.just_excluded += [n for n in reasons if n not in self.just_excluded]
        for old, new in change.swaps:
            self.emit("node_swapped", out=old, into=new, **at)
        if change.action == "stop":
            resolved.pool = change.pool
            return change.reason
        problem = self._shrink(change.pool, attempt) if change.action == "shrink" else None
        resolved.pool = change.pool
        self.faults.set_nodes(change.pool.active)
        if problem is not None:
            return problem
        resolved.write_hostfile()
        return None

    def _shrink(self, pool: nodes.NodePool, after_attempt: int | None) -> str | None:
        """The job goes on with `pool`'s fewer nodes: the worker flags that world needs (the
        global batch kept where the sizes divide, `spec.plan_shrink`), and the fault schedule
        told."""
        from supervisor.settings import worker_spec

        launch = self.cfg.launch
        ranks_per_node = launch.ranks_per_node
        # Planned from the first world, never from a plan of a plan.
        first = (len(self.resolved.nodes) - launch.spares) * ranks_per_node
        world = len(pool.active) * ranks_per_node
        spec = worker_spec.load(self.cfg.worker.module)
        if spec is None:  # no spec plans its flags: passed unchanged
            self.emit(
                "shrink", attempt=after_attempt, nodes=list(pool.active), world=[first, world]
            )
            self.faults.resize(world)
            return None
        plan = spec.plan_shrink(self.cfg.worker_flags(), first, world)
        if plan.problem is not None:
            return f"cannot go on with {len(pool.active)} node(s): {plan.problem}"
        self.emit("shrink", attempt=after_attempt, nodes=list(pool.active), **plan.event())
        self.resolved.worker_overrides = dict(plan.flags)
        self.faults.resize(plan.new_world)
        return None
