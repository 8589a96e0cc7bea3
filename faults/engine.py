"""The supervisor's side of faults/: facts in, firings out, actions carried out, one event each.

The supervisor's job loop calls four hooks: `attempt_started` / `attempt_over` around each
attempt, `poke` on every watch tick, and `on_message` for each verified rank message (rank 0's
steps, phases and checkpoint states fire step and save triggers within milliseconds). Everything the
engine decides comes from `Schedule.due`; everything it does is in `faults.actions`.

Every injected fault is one `fault` event (see `_fire` for its fields): what fired, why, whom
it hit (ranks, pids, hosts, the step and phase each was at), how it was delivered, and when
(`ts` wall and `mono` monotonic, read just before the first delivery).

Nothing here blocks the supervisor's event loop: signals and control sends never wait, and a
rank whose control socket is not connected yet is retried by a timer on the loop (every
CONTROL_RETRY_EVERY_S, for CONTROL_RETRY_S); if it never connects, a `fault_undelivered` event
follows the `fault` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts import ckpt_files, control_msgs
from faults import actions
from faults.schedule import Facts, Firing, Schedule
from faults.spec import DISRUPTIVE, IN_STEP, FaultSpec
from supervisor.watch import control as control_mod

CONTROL_RETRY_S = 0.2  # a rank whose control socket is not connected yet: retry this long
CONTROL_RETRY_EVERY_S = 0.02


@dataclass(eq=False)
class _Retry:
    """One firing's control commands to ranks not connected yet, retried from the event loop."""

    spec: FaultSpec
    n: int
    attempt: int
    deadline: float  # monotonic
    commands: dict[int, dict[str, Any]]  # rank -> its command, until sent
    failed: dict[int, str] = field(default_factory=dict)  # rank -> why not
    timer: asyncio.TimerHandle | None = None


class FaultEngine:
    def __init__(
        self,
        specs: list[FaultSpec],
        *,
        key: bytes,
        job_id: str,
        world: int,
        ranks_per_node: int,
        ckpt_dir: Path | None,
        bind: str,
        advertise: str,
        this_host: str,
        emit: Callable[..., None],
        control: actions.ControlServer | None = None,
    ) -> None:
        self.schedule = Schedule(specs)
        self.job_id, self.world, self.rpn = job_id, world, ranks_per_node
        self.ckpt_dir = ckpt_dir
        self.this_host = this_host
        self.emit = emit
        # The job's channel when it has one (a standby uses it too), else the engine's own.
        self._owns_control = control is None
        self.control = control or actions.ControlServer(key, job_id, bind, advertise)
        self.started = time.monotonic()
        self.attempt: int | None = None
        self.ready_since: float | None = None
        self.disrupted = False
        self.complete: set[int] = set()  # checkpoint steps reported complete, any attempt
        self.damaged: set[int] = set()  # ... and later corrupted or unmarked by a fault
        self.inflight: set[int] = set()  # async saves staged or written, not yet complete
        self.total = 0
        self.retrying: set[_Retry] = set()
        self.hits: dict[int, tuple[int, ...]] = {}  # attempt -> ranks its disruptive faults hit

    @classmethod
    def create(
        cls,
        cfg: Any,
        world: int,
        key: str,
        job_id: str,
        heartbeat_address: str,
        emit: Callable,
        control: actions.ControlServer | None = None,
    ) -> FaultEngine | None:
        """The engine of a job with [[faults]] (typed specs, checked against the resolved world
        by `supervisor.launch.resolve`), or None without (nothing of faults/ then runs)."""
        if not cfg.faults:
            return None
        from supervisor.launch import launcher

        bind, host = control_mod.bind_for(heartbeat_address)
        ckpt = cfg.worker.flags.get("ckpt_dir")
        ckpt_dir = Path(cfg.launch.cwd or ".", ckpt).absolute() if ckpt else None
        return cls(
            list(cfg.faults),
            key=key.encode(),
            job_id=job_id,
            world=world,
            ranks_per_node=cfg.launch.ranks_per_node,
            ckpt_dir=ckpt_dir,
            bind=bind,
            advertise=host,
            this_host=launcher.this_host(),
            emit=emit,
            control=control,
        )

    # --- hooks --------------------------------------------------------------------------------
    def attempt_started(self, attempt: int) -> None:
        self.attempt, self.disrupted = attempt, False
        self.ready_since: float | None = None  # when every rank of this attempt was training
        self.inflight.clear()

    def attempt_over(self) -> None:
        self.attempt = None

    def hit(self, attempt: int) -> tuple[int, ...]:
        return self.hits.get(attempt, ())

    def resize(self, world: int) -> None:
        self.world = world  # a target beyond it is never ready: it waits, and never fires

    def on_message(self, msg: dict[str, Any], table: Any, now: float) -> None:
        kind = msg["kind"]
        if kind == "ckpt":
            step, state = msg["step"], msg["state"]
            # Rank 0 says `complete` after it wrote the marker; others may say it just before.
            if state == "complete" and msg["rank"] == 0:
                self.complete.add(step)
                self.damaged.discard(step)  # saved anew after a resume
                self.inflight.discard(step)
            elif state in ("staged", "written"):  # not `memory`: no durable save in flight
                self.inflight.add(step)
        # Rank 0's steps, phases and checkpoints move step and save triggers: judge at once.
        # (Not every rank's message: with thousands of ranks that would be quadratic; the
        # watch loop's tick covers the rest within check_s.)
        if (
            msg["rank"] == 0
            and kind in ("step", "phase", "ckpt")
            and msg["attempt"] == self.attempt
        ):
            self.poke(table, now)

    def poke(self, table: Any, now: float) -> None:
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
        for retry in self.retrying:
            if retry.timer is not None:
                retry.timer.cancel()
        self.retrying.clear()
        self.emit("fault_summary", total=self.total, fired=self.schedule.fired())
        if self._owns_control:
            self.control.close()

    # --- facts and actions ----------------------------------------------------------------------
    def facts(self, table: Any, now: float) -> Facts:
        ranks = table.ranks
        saving = [st.step for st in ranks.values() if st.phase == "save"]
        if not saving and self.inflight:
            saving = [min(self.inflight)]
        good = self.complete - self.damaged
        ready = [r for r, st in ranks.items() if st.pid and not st.exited and st.phase != "done"]
        return Facts(
            elapsed_s=now - self.started,
            world=self.world,
            ranks_per_node=self.rpn,
            attempt=self.attempt if table.attempt == self.attempt else None,
            step=table.max_step,
            saving=max(saving) if saving else None,
            ckpt_complete=max(good) if good else None,
            ready=frozenset(ready),
            training=frozenset(r for r in ready if ranks[r].phase in ("train", "save")),
            disrupted=self.disrupted,
            finishing=bool(table.done_ranks),
        )

    def _fire(self, f: Firing, table: Any) -> None:
        spec, act = f.spec, f.spec.action
        wall, mono = actions.now_pair()
        elapsed = mono - self.started
        known = max(self.complete - self.damaged, default=None)
        marker = self._marker(known) if spec.trigger.after_checkpoint else None
        damage, errors = None, []
        if act.kind in ("corrupt", "unmark") and self.ckpt_dir is not None:
            if act.kind == "corrupt":
                damage = actions.corrupt(self.ckpt_dir, act.mode, f.ranks[0])
            else:
                damage = actions.unmark(self.ckpt_dir)
            if damage is None:
                errors.append(f"no complete checkpoint with shards in {self.ckpt_dir}")
            else:
                self.damaged.add(damage.step)
        sts = [table.ranks[r] for r in f.ranks]
        steps, phases = [st.step for st in sts], [st.phase for st in sts]
        vias, sent_errors, retrying = self._deliver(spec, f.n, sts, mono)
        errors += sent_errors
        if act.kind in DISRUPTIVE:
            self.disrupted = True
        if act.kind in DISRUPTIVE and act.kind not in ("corrupt", "unmark"):  # a rank's fault
            before = self.hits.get(table.attempt, ())
            self.hits[table.attempt] = tuple(sorted({*before, *f.ranks}))
        self.total += 1
        extra: dict[str, Any] = {}
        if act.kind not in IN_STEP:
            extra["signal"] = signal.Signals(act.signum).name
        if act.kind == "slow":
            extra["slow"] = {"delay_s": act.delay_s, "duration_s": act.duration_s}
        if damage is not None:
            extra["damaged"] = damage.as_dict()
        if f.due_s is not None:
            extra["due_s"] = round(f.due_s, 6)
            extra["late_s"] = round(elapsed - f.due_s, 6)
            # Of that, the time the ranks were not training (starting, or between attempts).
            ready = self.ready_since if self.ready_since is not None else elapsed
            extra["wait_s"] = round(max(0.0, min(ready, elapsed) - f.due_s), 6)
        if marker is not None:
            extra["marker"] = marker
        if retrying:
            extra["retrying"] = retrying
        if errors:
            extra["errors"] = errors
        t = spec.trigger
        self.emit(
            "fault",
            ts=round(wall, 6),
            mono=round(mono, 6),
            fault=spec.index,
            name=spec.label,
            n=f.n,
            total=self.total,
            attempt=table.attempt,
            trigger=t.kind,
            point=f.point,
            after_checkpoint=t.after_checkpoint,
            action=act.kind,
            target=str(spec.target),
            ranks=list(f.ranks),
            pids=[st.pid for st in sts],
            hosts=[st.host for st in sts],
            steps=steps,
            phases=phases,
            via=vias,
            step=table.max_step,
            ckpt_complete=known,
            elapsed_s=round(elapsed, 6),
            **extra,
        )

    def _marker(self, step: int | None) -> dict[str, Any]:
        """The gate's evidence: the `.complete` the fault waited for, and when it was written."""
        marker = {"step": step, "mtime": None}
        if step is not None and self.ckpt_dir is not None:
            with contextlib.suppress(OSError):
                path = ckpt_files.marker(self.ckpt_dir, step)
                marker["mtime"] = round(path.stat().st_mtime, 6)
        return marker

    def _deliver(
        self, spec: FaultSpec, n: int, sts: list[Any], mono: float
    ) -> tuple[list[str], list[str], list[int]]:
        """Signal or command each target rank now, without waiting: (how each was reached,
        errors, ranks whose command is retried because their control socket is not connected
        yet)."""
        act = spec.action
        vias, errors = [], []
        attempt = self.attempt if self.attempt is not None else -1
        later: dict[int, dict[str, Any]] = {}
        for st in sts:
            remote = st.host != self.this_host
            via = "control" if spec.via == "control" or act.kind in IN_STEP or remote else "signal"
            vias.append(via)
            if via == "signal":
                err = actions.send_signal(st.pid, act.signum)
            else:
                command = self._command(spec, attempt, st.rank)
                err = self.control.send(attempt, st.rank, command)
                if err is not None and "not connected" in err:
                    later[st.rank], err = command, None
            if err:
                errors.append(f"rank {st.rank}: {err}")
        if later and not self._retry_later(_Retry(spec, n, attempt, mono + CONTROL_RETRY_S, later)):
            errors += [f"rank {r}: rank not connected to the control channel" for r in later]
            later = {}
        return vias, errors, sorted(later)

    def _command(self, spec: FaultSpec, attempt: int, rank: int) -> dict[str, Any]:
        act = spec.action
        return control_msgs.control_message(
            self.job_id,
            attempt,
            rank,
            time.time(),
            act.kind if act.kind in IN_STEP else "signal",
            spec.index,
            signal=0 if act.kind in IN_STEP else act.signum,
            delay_s=act.delay_s,
            duration_s=act.duration_s,
        )

    # --- ranks not connected yet: retried on the loop, never waited for -------------------------
    def _retry_later(self, retry: _Retry) -> bool:
        """Schedule the next try; False without a running event loop (nothing to retry on)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        retry.timer = loop.call_later(CONTROL_RETRY_EVERY_S, self._retry, retry)
        self.retrying.add(retry)
        return True

    def _retry(self, retry: _Retry) -> None:
        self.retrying.discard(retry)
        for rank, command in list(retry.commands.items()):
            err = self.control.send(retry.attempt, rank, command)
            if err is None or "not connected" not in err:
                del retry.commands[rank]
                if err is not None:
                    retry.failed[rank] = err
        if retry.commands and time.monotonic() < retry.deadline:
            self._retry_later(retry)
            return
        failed = {**retry.failed, **{r: "rank not connected to the control channel"
                                     for r in retry.commands}}  # fmt: skip
        if failed:
            self.emit(
                "fault_undelivered",
                attempt=retry.attempt,
                fault=retry.spec.index,
                name=retry.spec.label,
                n=retry.n,
                ranks=sorted(failed),
                errors=[f"rank {r}: {e}" for r, e in sorted(failed.items())],
            )
