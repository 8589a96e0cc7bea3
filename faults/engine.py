"""The supervisor's side of faults/: facts in, firings out, actions carried out, one event each.

The supervisor's job loop calls four hooks: `attempt_started` / `attempt_over` around each
attempt, `fire_due` on every watch tick, and `on_message` for each verified rank message (rank
0's steps, phases and checkpoint states fire step and save triggers within milliseconds).
Everything the engine decides comes from `Schedule.due`; checkpoint damage is in
`faults.actions`, signals and control commands in `faults.delivery`. What it needs of the
supervisor (its control channel, its rank table, its host name, its event log) is handed in
(`faults.protocols`).

Every injected fault is one `fault` event (see `_fire` for its fields): what fired, why, whom
it hit (ranks, pids, hosts, the step and phase each was at), how it was delivered, and when
(`ts` wall and `mono` monotonic, read just before the first delivery). A `fault` event means
the action was carried out: a `nan` or `spike` is written when its rank says it acted at its
step, a command to a rank not connected yet once it got there (`faults.inflight`); a rank it
did not reach is in a `fault_undelivered` event, with why.

Nothing here blocks the supervisor's event loop: signals and control sends never wait, and a
rank not connected to the control channel yet is retried from the loop (`faults.delivery`).
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts import ckpt_files, scratch
from faults.actions import Damage, corrupt, now_pair, remove_tree, unmark
from faults.delivery import Delivered, Delivery
from faults.inflight import InFlight, Key, Pending, events
from faults.partition import Partitions
from faults.protocols import ControlChannel, RankTable
from faults.schedule import Facts, Firing, Schedule
from faults.spec import DISRUPTIVE, IN_STEP, NUMERIC, FaultSpec

CKPT_DAMAGE = ("corrupt", "unmark")


@dataclass
class CkptLedger:
    """What the ranks said of checkpoints, and what the faults did to them."""

    complete: set[int] = field(default_factory=set)  # steps reported complete, any attempt
    damaged: set[int] = field(default_factory=set)  # ... and later corrupted or unmarked
    inflight: set[int] = field(default_factory=set)  # async saves staged or written, not complete

    def heard(self, msg: dict[str, Any]) -> None:
        """A `ckpt` message of any rank."""
        step, state = msg["step"], msg["state"]
        # Rank 0 says `complete` after it wrote the marker; others may say it just before.
        if state == "complete" and msg["rank"] == 0:
            self.complete.add(step)
            self.damaged.discard(step)  # saved anew after a resume
            self.inflight.discard(step)
        elif state in ("staged", "written"):  # not `memory`: no durable save in flight
            self.inflight.add(step)

    def newest_good(self) -> int | None:
        """The newest checkpoint known complete and not damaged since."""
        return max(self.complete - self.damaged, default=None)


class FaultEngine:
    """The declared schedule run against one job: the hooks its loop calls."""

    def __init__(
        self,
        specs: list[FaultSpec],
        *,
        job_id: str,
        world: int,
        ranks_per_node: int,
        ckpt_dir: Path | None,
        this_host: str,
        emit: Callable[..., None],
        control: ControlChannel,
        owns_control: bool = False,
        mem_env: Mapping[str, str] | None = None,
        others: Callable[[], Sequence[RankTable]] | None = None,
    ) -> None:
        """`control`: the job's channel to its ranks, closed with the engine when it
        `owns_control` (else the job closes it). `mem_env`: the ranks' environment when they
        keep a memory tier (where a lost node's memory root is, `scratch.mem_root`). `others`:
        the rank tables of the job's other live attempts (its standby), whose ranks on a lost
        node die with it."""
        self.schedule = Schedule(specs)
        self.world, self.ranks_per_node = world, ranks_per_node
        self.ckpt_dir = ckpt_dir
        self.emit = emit
        self.control, self.owns_control = control, owns_control
        self.delivery = Delivery(control, job_id, this_host, self._retried)
        self.inflight = InFlight()  # firings whose `fault` event waits for their ranks
        self.started = time.monotonic()
        self.attempt: int | None = None
        self.ready_since: float | None = None  # when every rank of this attempt was training
        self.disrupted = False
        self.ckpts = CkptLedger()
        self.total = 0
        self.applied: dict[str, int] = {s.label: 0 for s in specs}  # `fault` events by fault
        self.faulted: dict[int, tuple[int, ...]] = {}  # attempt -> ranks its disruptive faults hit
        self.mem_env = dict(mem_env) if mem_env is not None else None
        self.others = others
        self.nodes: list[str] = []  # the job's nodes in rank order (node:N is nodes[N])
        self.down: set[str] = set()  # nodes a node_loss took away: down until the job ends
        self.partitions = Partitions(emit)  # nodes a partition cut off, until healed

    # --- hooks --------------------------------------------------------------------------------
    def attempt_started(self, attempt: int) -> None:
        self.attempt, self.disrupted = attempt, False
        self.ready_since = None
        self.ckpts.inflight.clear()
        back, resolved = self.inflight.attempt_over(attempt)  # the earlier ones' words are in
        for p in back:  # a nan or spike whose attempt ended before its step: this one gets it
            self.schedule.give_back(p.key[1], p.fields["point"])
        self._resolved(resolved)

    def attempt_over(self) -> None:
        self.attempt = None

    def ranks_faulted(self, attempt: int) -> tuple[int, ...]:
        return self.faulted.get(attempt, ())

    def resize(self, world: int) -> None:
        self.world = world  # a target outside it is never ready: it waits, and never fires

    def set_nodes(self, names: Sequence[str]) -> None:
        """The job's nodes now, in rank order (a spare swapped in takes its node's place)."""
        self.nodes = list(names)

    def nodes_down(self) -> frozenset[str]:
        """The nodes a node_loss took away: their node check fails until the job ends."""
        return frozenset(self.down)

    def on_message(self, msg: dict[str, Any], table: RankTable, now: float) -> None:
        kind = msg["kind"]
        if kind == "ckpt":
            self.ckpts.heard(msg)
        if kind == "fault_ack":  # a nan or spike carried out (or come too late)
            self._resolved(self.inflight.acked(msg["attempt"], msg["rank"], msg))
        # Rank 0's steps, phases and checkpoints move step and save triggers: judge at once.
        # (Not every rank's message: with thousands of ranks that would be quadratic; the
        # watch loop's tick covers the rest within check_s.)
        if (
            msg["rank"] == 0
            and kind in ("step", "phase", "ckpt")
            and msg["attempt"] == self.attempt
        ):
            self.fire_due(table, now)

    def fire_due(self, table: RankTable | None, now: float) -> None:
        """Fire every fault the schedule says is due, given the table as it is `now`."""
        if table is None:
            return
        facts = self.facts(table, now)
        if (
            self.ready_since is None
            and facts.attempt is not None
            and facts.step is not None
            and len(facts.training) == self.world
        ):
            self.ready_since = facts.elapsed_s
        for firing in self.schedule.due(facts):
            self._fire(firing, table)

    def close(self) -> None:
        self.delivery.cancel()
        self.partitions.heal_all()  # cut until the job ends: healed now
        self._resolved(self.inflight.close())
        self.emit("fault_summary", total=self.total, fired=dict(self.applied))
        if self.owns_control:
            self.control.close()

    # --- facts and actions ----------------------------------------------------------------------
    def facts(self, table: RankTable, now: float) -> Facts:
        ranks = table.ranks
        saving = [st.step for st in ranks.values() if st.phase == "save"]
        if not saving and self.ckpts.inflight:
            saving = [min(self.ckpts.inflight)]
        ready = [r for r, st in ranks.items() if st.pid and not st.exited and st.phase != "done"]
        return Facts(
            elapsed_s=now - self.started,
            world=self.world,
            ranks_per_node=self.ranks_per_node,
            attempt=self.attempt if table.attempt == self.attempt else None,
            step=table.max_step,
            saving=max(saving) if saving else None,
            ckpt_complete=self.ckpts.newest_good(),
            ready=frozenset(ready),
            training=frozenset(r for r in ready if ranks[r].phase in ("train", "save")),
            disrupted=self.disrupted,
            finishing=bool(table.done_ranks),
        )

    def _fire(self, f: Firing, table: RankTable) -> None:
        spec, act = f.spec, f.spec.action
        wall, mono = now_pair()
        extra: dict[str, Any] = {}
        elapsed = mono - self.started
        known = self.ckpts.newest_good()
        marker = self._marker(known) if spec.trigger.after_checkpoint else None
        damage, errors = self._damage(f)
        sts = [table.ranks[r] for r in f.ranks]
        steps, phases = [st.step for st in sts], [st.phase for st in sts]
        attempt = self.attempt if self.attempt is not None else -1
        if act.kind == "partition":  # nothing to the ranks: their node's link is cut
            sent = Delivered(["link"] * len(sts), {}, [])
            extra["node"], more = self._partition(f)
            errors += more
        else:
            sent = self.delivery.deliver(spec, f.n, attempt, sts, mono, f.at_step or 0)
        errors += sent.errors
        lost = None
        if act.kind == "node_loss":  # its standby's ranks too, then (all killed) its memory
            extra["standby_pids"], more = self._kill_others(f, table.attempt, mono)
            errors += more
            lost = self._lose_node(f)
        if act.kind in DISRUPTIVE:
            self.disrupted = True
        if act.kind in DISRUPTIVE and act.kind not in CKPT_DAMAGE:  # a rank's fault
            before = self.faulted.get(table.attempt, ())
            self.faulted[table.attempt] = tuple(sorted({*before, *f.ranks}))
        if act.kind not in IN_STEP and act.kind != "partition":
            extra["signal"] = signal.Signals(act.signum).name
        if act.kind in ("slow", "partition"):
            extra["duration_s"] = act.duration_s
        if act.kind == "slow":
            extra["slow"] = {"delay_s": act.delay_s, "duration_s": act.duration_s}
        if act.kind == "spike":
            extra["factor"] = act.factor
        if damage is not None:
            extra["damaged"] = damage.as_dict()
        if lost is not None:
            extra["node"], extra["mem_root_removed"] = lost
        if f.due_s is not None:
            extra["due_s"] = round(f.due_s, 6)
            extra["late_s"] = round(elapsed - f.due_s, 6)
            # Of that, the time the ranks were not training (starting, or between attempts).
            ready = self.ready_since if self.ready_since is not None else elapsed
            extra["wait_s"] = round(max(0.0, min(ready, elapsed) - f.due_s), 6)
        if marker is not None:
            extra["marker"] = marker
        deferred = act.kind in NUMERIC or bool(sent.retrying)  # done only once they say
        if deferred:  # the ranks it did not reach: in its `fault_undelivered`
            errors = [e for e in errors if e not in sent.errors]
        if errors:
            extra["errors"] = errors
        t = spec.trigger
        fields = dict(
            fault=spec.index, name=spec.label, n=f.n, attempt=table.attempt, trigger=t.kind,
            point=f.point, after_checkpoint=t.after_checkpoint, action=act.kind,
            target=str(spec.target), ranks=list(f.ranks), pids=[st.pid for st in sts],
            hosts=[st.host for st in sts], steps=steps, phases=phases, via=sent.via,
            step=table.max_step, ckpt_complete=known, elapsed_s=round(elapsed, 6), **extra,
        )  # fmt: skip
        if not deferred:
            self._emit_fault(fields, ts=round(wall, 6), mono=round(mono, 6))
            return
        key = (table.attempt, spec.index, f.n)
        waiting = {r for r in f.ranks if r not in sent.failed}
        p = Pending(key, fields, f.at_step, mono, waiting, failed=dict(sent.failed))
        if f.at_step is None:  # sent at once: done (a nan or spike waits for the rank's word)
            for rank in waiting - set(sent.retrying):
                p.answer(rank)
        self._resolved(self.inflight.hold(p))

    def _emit_fault(self, fields: dict[str, Any], **stamps: float) -> None:
        """One `fault` event: the action was carried out (`stamps`: when it was sent)."""
        self.total += 1
        self.applied[fields["name"]] += 1
        self.emit("fault", **stamps, total=self.total, **fields)

    def _resolved(self, done: list[Pending]) -> None:
        for p in done:
            for name, fields in events(p):
                if name == "fault":
                    self._emit_fault(fields)
                else:
                    self.emit(name, **fields)

    def _retried(self, key: Key, sent: list[int], failed: dict[int, str]) -> None:
        """A firing's retries ended (faults.delivery)."""
        done = self.inflight.retried(key, sent, failed)
        if done is not None:
            self._resolved(done)
        elif failed:  # a lost node's standby ranks (`_kill_others`): no event of their own
            attempt, index, n = key
            spec = self.schedule.specs[index]
            self.emit(
                "fault_undelivered", attempt=attempt, fault=index, name=spec.label, n=n,
                action=spec.action.kind, ranks=sorted(failed),
                errors=[f"rank {r}: {why}" for r, why in sorted(failed.items())],
            )  # fmt: skip

    def _damage(self, f: Firing) -> tuple[Damage | None, list[str]]:
        """`corrupt` or `unmark` the newest complete checkpoint: (what it did, errors)."""
        act = f.spec.action
        if act.kind not in CKPT_DAMAGE or self.ckpt_dir is None:
            return None, []
        if act.kind == "corrupt":
            damage = corrupt(self.ckpt_dir, act.mode, f.ranks[0])
        else:
            damage = unmark(self.ckpt_dir)
        if damage is None:
            return None, [f"no complete checkpoint with shards in {self.ckpt_dir}"]
        self.ckpts.damaged.add(damage.step)
        return damage, []

    def _kill_others(self, f: Firing, attempt: int, mono: float) -> tuple[list[int], list[str]]:
        """node_loss: the same ranks of the job's other live attempts than `attempt` (a standby
        on that node) die too: (their pids, errors)."""
        pids: list[int] = []
        errors: list[str] = []
        for other in self.others() if self.others is not None else ():
            if other.attempt == attempt:
                continue
            sts = [st for r in f.ranks if (st := other.ranks.get(r)) and st.pid and not st.exited]
            if sts:
                sent = self.delivery.deliver(f.spec, f.n, other.attempt, sts, mono)
                pids += [st.pid for st in sts]
                errors += [f"attempt {other.attempt} {e}" for e in sent.errors]
        return pids, errors

    def _partition(self, f: Firing) -> tuple[str | list[str], list[str]]:
        """partition: cut the target's node(s) off (a rank target: its node), healed after
        `duration_s` (0: when the job ends). Their processes live on: the supervisor has to
        find them out of reach, and their leases to stop them."""
        per = max(1, self.ranks_per_node)
        spec = f.spec
        indices = spec.target.nodes if spec.target.kind == "node" else [f.ranks[0] // per]
        names = [self.nodes[i] for i in indices if i < len(self.nodes)]
        errors = self.partitions.cut_off(names, spec.action.duration_s)
        return (names[0] if len(names) == 1 else names), errors

    def _lose_node(self, f: Firing) -> tuple[Any, Any]:
        """node_loss: the node goes down for the rest of the job, and its own memory root (with
        per-node roots; a shared one is not the node's to lose) goes with it: (node, root), or
        for a range of nodes (their names, their roots)."""
        lost = [self._lose_one(i) for i in f.spec.target.nodes]
        if f.spec.target.last is None:
            return lost[0]
        return [n for n, _ in lost], [r for _, r in lost]

    def _lose_one(self, index: int) -> tuple[str | None, str | None]:
        node = self.nodes[index] if index < len(self.nodes) else None
        if node is None:
            return None, None
        self.down.add(node)
        env = self.mem_env
        if env is None or not scratch.per_node(env):
            return node, None
        root = scratch.mem_root(env, node)
        return node, root if remove_tree(root) else None

    def _marker(self, step: int | None) -> dict[str, Any]:
        """The gate's evidence: the `.complete` the fault waited for, and when it was written."""
        marker = {"step": step, "mtime": None}
        if step is not None and self.ckpt_dir is not None:
            with contextlib.suppress(OSError):
                path = ckpt_files.marker(self.ckpt_dir, step)
                marker["mtime"] = round(path.stat().st_mtime, 6)
        return marker
