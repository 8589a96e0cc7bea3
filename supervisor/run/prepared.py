"""Prepared ranks on every node and spare ([restart] warm_spare): a warm start for the relaunch
that the standby cannot serve.

A standby is one launch over the job's nodes, so a lost node ends it: the relaunch onto a spare
was cold (interpreter, imports, process group, model, a cold step). The keeper holds, once the
standby is ready, a `worker.prepared` process per rank slot on each node and spare, launched one
node at a time (a lost node ends only its own launch). They have imported torch and hold no rank
number. A relaunch that takes no standby hands them its ranks' variables (`become`): each node of
the new list gives its prepared ranks, the spare's included, and the process group is formed
after the word. They are kept until used or the job ends; a new set follows the next standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import env_names
from supervisor.launch import hosts
from supervisor.launch.launch_group import LaunchGroup
from supervisor.launch.processes import Launched
from supervisor.policy import exits, prepared_rules
from supervisor.run.context import JobContext
from supervisor.watch.rank_table import AttemptTable

LAUNCH_AFTER_S = 0.2  # how often a launch waiting for the standby to be ready looks again
END_GRACE_S = 1.0  # prepared ranks told to exit hold nothing: a short grace, then the teardown
# Told to become, a prepared rank says hello at once (imported, nothing to start): one that has
# not within this is judged at once (its word lost) rather than after the init timeout.
HELLO_S = 10.0
# What a `become` never carries: the prepared rank has it from its launch, and the job's key
# crosses no channel it need not (the control channel admits only holders of it, encrypted).
NOT_SENT = (env_names.ENV_HEARTBEAT_KEY,)


@dataclass
class Adopted:
    """Prepared ranks taken for an attempt: their launches, and for each rank of the attempt
    the prepared rank that becomes it."""

    number: int  # the prepared ranks' own attempt number (their control identities)
    group: LaunchGroup
    chosen: list[int]
    nodes: list[str]
    ranks_per_node: int


class PreparedRanks:
    """Keeps at most one set of prepared ranks, on the active nodes and the spares."""

    def __init__(
        self,
        job: JobContext,
        next_number: Callable[[], int],
        standby_ready: Callable[[], bool],
    ) -> None:
        self.job = job
        self.next_number = next_number
        self.standby_ready = standby_ready
        self.number: int | None = None
        self.table: AttemptTable | None = None
        self.launches: dict[str, Launched] = {}  # node -> its prepared ranks' launch
        self.bases: dict[str, int] = {}  # node -> its first prepared rank
        self.overrides: dict[str, Any] = {}
        self._task: asyncio.Task | None = None
        self._watches: set[asyncio.Future] = set()  # each kept node's launch, until it ends
        self._endings: set[asyncio.Future] = set()
        self.over = False
        self.ready_said = False
        self.nodes: list[str] = []  # the nodes the set is launched on

    def ensure(self) -> None:
        """Keep prepared ranks from now on (launched once the standby is ready)."""
        if self._task is None and not self.over:
            self._task = asyncio.get_running_loop().create_task(self._launch())

    async def _launch(self) -> None:
        while not self.standby_ready():
            await asyncio.sleep(LAUNCH_AFTER_S)
        resolved, cfg = self.job.resolved, self.job.resolved.cfg
        per_node = cfg.launch.ranks_per_node
        down = self.job.faults.nodes_down()
        nodes = [n for n in [*resolved.pool.active, *resolved.pool.spares] if n not in down]
        number = self.number = self.next_number()
        self.table = AttemptTable(number, per_node * len(nodes), time.monotonic())
        self.overrides = dict(resolved.worker_overrides)
        self.ready_said, self.nodes = False, nodes
        folder = resolved.run_dir / "attempts" / f"{number:03d}"
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
        env = self.job.rank_env(number, folder, standby=False)
        env[env_names.ENV_PREPARED_WORLD] = str(self.table.world)
        cwd = cfg.launch.cwd or None
        for k, node in enumerate(nodes):
            base = k * per_node
            plan = resolved.prepared_plan({**env, env_names.ENV_PREPARED_BASE: str(base)}, node)
            with contextlib.suppress(OSError):
                (folder / f"command-{node}.txt").write_text(plan.text())
            try:
                run = await self.job.launcher.start(plan, folder / f"output-{node}.log", cwd, None)
            except OSError as exc:
                self.job.emit("prepared_failed", attempt=number, node=node, reason=str(exc))
                continue
            self.launches[node], self.bases[node] = run, base
            watch = asyncio.ensure_future(self._watch(node, run))
            self._watches.add(watch)
            watch.add_done_callback(self._watches.discard)
        self.job.emit("prepared_launch", attempt=number, nodes=nodes, world=self.table.world)

    async def _watch(self, node: str, run: Launched) -> None:
        """A kept node's prepared ranks that end while they wait are said at once (the node
        lost, or a rank killed); they are not replaced until the next set."""
        ended = await run.wait()
        if self.launches.get(node) is run:
            self.job.emit(
                "prepared_lost", attempt=self.number, node=node,
                reason=f"their launch ended ({exits.describe_returncode(ended.returncode)})",
            )  # fmt: skip

    def on_message(self, msg: dict[str, Any], now: float) -> None:
        """A verified message of a prepared rank: its phase (waiting once `standby`)."""
        table = self.table
        if table is None or msg["attempt"] != table.attempt:
            return
        table.update(msg, now)
        if msg["kind"] == "phase":  # only a phase moves one to waiting
            self._say_if_ready(now)

    def _say_if_ready(self, now: float) -> None:
        """`prepared_ready` once all the ranks of every node of the set wait (never where a
        node's launch could not start or ended first: `prepared_failed`, `prepared_lost`)."""
        table = self.table
        if table is None or self.ready_said:
            return
        waiting, per_node = self.ready(), self.job.resolved.cfg.launch.ranks_per_node
        every = bool(waiting) and sorted(waiting) == sorted(self.nodes)
        if every and all(len(w) == per_node for w in waiting.values()):
            self.ready_said = True
            self.job.emit(
                "prepared_ready",
                attempt=table.attempt,
                seconds=round(now - table.launched_at, 6),
                nodes=list(waiting),
            )

    def ready(self) -> dict[str, list[int]]:
        """Per node whose launch still runs: its prepared ranks that wait."""
        table, per_node = self.table, self.job.resolved.cfg.launch.ranks_per_node
        if table is None:
            return {}
        out: dict[str, list[int]] = {}
        for node, run in self.launches.items():
            if run.exits:  # its launch ended: a lost node, or a rank that failed
                continue
            base = self.bases[node]
            mine = [table.ranks.get(r) for r in range(base, base + per_node)]
            out[node] = [st.rank for st in mine if st is not None and st.phase == "standby"]
        return out

    def starting_nodes(self) -> set[str]:
        """The nodes whose prepared ranks are launched and not all waiting yet."""
        if self.table is None:
            return set()
        waiting, per_node = self.ready(), self.job.resolved.cfg.launch.ranks_per_node
        return {
            node
            for node, run in self.launches.items()
            if not run.exits and len(waiting.get(node, ())) < per_node
        }

    def take(self, nodes: list[str]) -> tuple[Adopted | None, str | None]:
        """The prepared ranks for an attempt on `nodes`, or (None, why not). Those not taken
        are ended in the background; either way none are kept until `ensure`."""
        number, per_node = self.number, self.job.resolved.cfg.launch.ranks_per_node
        if number is None or self.table is None:
            return None, "no prepared ranks launched yet"
        if self.overrides != self.job.resolved.worker_overrides:
            chosen: list[int] | str = "the worker's flags changed (a smaller world)"
        else:
            chosen = prepared_rules.placement(nodes, self.ready(), per_node)
        taken = {n: self.launches[n] for n in nodes} if not isinstance(chosen, str) else {}
        self._end_all(keep=set(taken.values()), reason="not taken")
        self._reset()
        if isinstance(chosen, str):
            self._let_go(number)
            return None, chosen
        group = LaunchGroup(list(taken.values()), started=time.monotonic())
        return Adopted(number, group, chosen, list(nodes), per_node), None

    def tables(self) -> list[AttemptTable]:
        """Their ranks, for a fault that takes their node (`node_loss`): prepared rank r runs
        where rank r of the job's nodes does (the spares' after them)."""
        return [self.table] if self.table is not None else []

    def _reset(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        for watch in list(self._watches):
            watch.cancel()
        self.number, self.table, self.launches, self.bases = None, None, {}, {}

    def _let_go(self, number: int) -> None:
        """Told to exit (or to become ranks): their control identities are claimed no more."""
        if self.job.control is not None:
            self.job.control.forget(number)

    def _end_all(self, keep: set[Launched], reason: str) -> None:
        number, control = self.number, self.job.control
        for node, run in self.launches.items():
            if run in keep:
                continue
            if control is not None and number is not None:
                base = self.bases[node]
                for r in range(base, base + self.job.resolved.cfg.launch.ranks_per_node):
                    control.command(number, r, "exit", time.time())
            ending = asyncio.ensure_future(self._end(run, node, reason))
            self._endings.add(ending)
            ending.add_done_callback(self._endings.discard)

    async def _end(self, run: Launched, node: str, reason: str) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.wait(), END_GRACE_S)
        result = await run.teardown(0.0)
        self.job.emit(
            "prepared_exit", node=node, reason=reason, killed=result.killed,
            survivors=len(result.survivors),
        )  # fmt: skip

    async def close(self, reason: str) -> None:
        """End every prepared rank; keep none from now on."""
        self.over = True
        self._end_all(keep=set(), reason=reason)
        if self.number is not None:
            self._let_go(self.number)
        self._reset()
        while self._endings:
            await asyncio.wait(set(self._endings))


async def become(
    adopted: Adopted, job: JobContext, number: int, folder: Path, emit: Callable[..., None]
) -> str | None:
    """Tell each chosen prepared rank that it is now rank r of attempt `number` (the attempt's
    variables but the key, its rank's and the rendezvous). None when every word was sent; else
    why not, and the prepared ranks are torn down (those told already with them)."""
    with contextlib.suppress(OSError):  # a full run dir: the attempt runs all the same
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "command.txt").write_text(
            f"# prepared ranks of attempt {adopted.number} on {', '.join(adopted.nodes)}: their "
            f"launches' commands and output are in attempts/{adopted.number:03d}/\n"
        )
    control, master = job.control, adopted.nodes[0]
    local = job.resolved.cfg.launch.emulate_nodes or hosts.is_this_host(master)
    env = job.rank_env(number, folder, standby=False)
    shared = {
        **{name: value for name, value in env.items() if name not in NOT_SENT},
        "WORLD_SIZE": str(len(adopted.chosen)),
        "LOCAL_WORLD_SIZE": str(adopted.ranks_per_node),
        "MASTER_ADDR": "127.0.0.1" if local else master,
        "MASTER_PORT": str(hosts.free_port() if local else hosts.rendezvous_port(master)),
    }
    why = "no control channel" if control is None else None
    t = time.time()
    for rank, prepared in enumerate(adopted.chosen):
        if control is None:
            break
        mine = {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank % adopted.ranks_per_node)}
        err = control.command(adopted.number, prepared, "become", t, mine)
        if err is not None:
            why = f"prepared rank {prepared}: {err}"
            break
    if control is not None:  # they are the attempt's ranks now, or torn down: let go
        control.forget(adopted.number)
    if why is None:
        return None
    emit("prepared_failed", reason=why, prepared=adopted.number)
    await adopted.group.teardown(0.0)
    return why
