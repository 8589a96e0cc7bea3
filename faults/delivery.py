"""Carrying one firing to its ranks without ever blocking the supervisor's event loop.

A rank on this host is signalled by its pid; a rank elsewhere, a `via = "control"` fault, and
`stall` / `slow` / `nan` / `spike` (carried out inside the rank's step) get a signed command on
the control channel. A rank whose control socket is not connected yet is retried by a timer on
the loop (every CONTROL_RETRY_EVERY_S, for CONTROL_RETRY_S); the engine is told which ranks
got it in the end and which did not, and why (`retried`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts import control_msgs
from faults.actions import send_signal
from faults.protocols import ControlChannel, RankView
from faults.spec import IN_STEP, FaultSpec

CONTROL_RETRY_S = 0.2  # a rank whose control socket is not connected yet: retry this long
CONTROL_RETRY_EVERY_S = 0.02
NOT_CONNECTED = "rank not connected to the control channel"


@dataclass(frozen=True)
class Delivered:
    """How a firing reached its ranks, at once."""

    via: list[str]  # per rank: "signal" or "control"
    failed: dict[int, str]  # rank -> why it did not reach it
    retrying: list[int]  # ranks whose command waits for their control socket to connect

    @property
    def errors(self) -> list[str]:
        return [f"rank {r}: {why}" for r, why in self.failed.items()]


# A firing's retries ended: its key (attempt, fault index, n), the ranks that got the command
# then, and those that never did, with why.
Retried = Callable[[tuple[int, int, int], list[int], dict[int, str]], None]


@dataclass(eq=False)
class _Retry:
    """One firing's control commands to ranks not connected yet, retried from the event loop."""

    spec: FaultSpec
    n: int
    attempt: int
    deadline: float  # monotonic
    commands: dict[int, dict[str, Any]]  # rank -> its command, until sent
    failed: dict[int, str] = field(default_factory=dict)  # rank -> why not
    sent: list[int] = field(default_factory=list)  # ranks that got it on a retry
    timer: asyncio.TimerHandle | None = None


class Delivery:
    """Signals and control commands for firings, and the retries still pending."""

    def __init__(
        self, control: ControlChannel, job_id: str, this_host: str, retried: Retried
    ) -> None:
        self.control, self.job_id, self.this_host = control, job_id, this_host
        self.retried = retried
        self.retrying: set[_Retry] = set()

    def deliver(
        self,
        spec: FaultSpec,
        n: int,
        attempt: int,
        ranks: Sequence[RankView],
        mono: float,
        at_step: int = 0,
    ) -> Delivered:
        """Signal or command each target rank now, without waiting (`mono`: the firing's
        monotonic time, from which the retries count; `at_step`: a nan's or spike's step)."""
        act = spec.action
        vias: list[str] = []
        failed: dict[int, str] = {}
        later: dict[int, dict[str, Any]] = {}
        for st in ranks:
            remote = st.host != self.this_host
            via = "control" if spec.via == "control" or act.kind in IN_STEP or remote else "signal"
            vias.append(via)
            if via == "signal":
                err = send_signal(st.pid, act.signum)
            else:
                command = self._command(spec, attempt, st.rank, at_step)
                err = self.control.send(attempt, st.rank, command)
                if err is not None and "not connected" in err:
                    later[st.rank], err = command, None
            if err:
                failed[st.rank] = err
        if later and not self._retry_later(_Retry(spec, n, attempt, mono + CONTROL_RETRY_S, later)):
            failed.update({r: NOT_CONNECTED for r in later})
            later = {}
        return Delivered(vias, failed, sorted(later))

    def cancel(self) -> None:
        """Drop the retries still pending (the job is over)."""
        for retry in self.retrying:
            if retry.timer is not None:
                retry.timer.cancel()
        self.retrying.clear()

    def _command(self, spec: FaultSpec, attempt: int, rank: int, at_step: int) -> dict[str, Any]:
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
            step=at_step,  # nan / spike: the step it acts at (faults.schedule sends it ahead)
            factor=act.factor,
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
                else:
                    retry.sent.append(rank)
        if retry.commands and time.monotonic() < retry.deadline:
            self._retry_later(retry)
            return
        failed = {**retry.failed, **{r: NOT_CONNECTED for r in retry.commands}}
        self.retried((retry.attempt, retry.spec.index, retry.n), sorted(retry.sent), failed)
