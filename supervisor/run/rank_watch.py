"""What one attempt knows of its ranks, and the clock that judges them.

The ranks' messages are folded into the attempt's rank table (with the events they make), this
host's rank processes are watched (`LocalExits`), and every check judges the table: liveness and
progress while the attempt runs, liveness alone while a standby waits for `go`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from supervisor.launch import hosts, subreaper
from supervisor.policy import exits, liveness, standby_rules
from supervisor.policy.liveness import Finding
from supervisor.run import attempt_events
from supervisor.run.context import Running
from supervisor.run.local_exits import LocalExits
from supervisor.settings.config import HeartbeatConfig
from supervisor.watch.rank_table import AttemptTable

PROGRESS_EVERY_S = 5.0  # a `progress` event at most this often


class RankWatch:
    """The ranks of one attempt as its checks see them; `emit` is the attempt's."""

    def __init__(
        self, table: AttemptTable, heartbeat: HeartbeatConfig, emit: Callable[..., None]
    ) -> None:
        self.table = table
        self.heartbeat = heartbeat
        self.emit = emit
        self.exits = LocalExits(table)  # when this host's ranks end, to the millisecond
        self.error_at: dict[int, float] = {}  # rank -> when its error message came (monotonic)
        self.prepared = ""  # what a standby holds ready, as its rank 0 says it
        self.cpu_s: dict[int, float] = {}  # rank -> the CPU seconds its standby's preparation took
        self.ready_at: float | None = None  # monotonic: every standby rank said it waits
        self._last_progress_event = 0.0

    def on_message(self, msg: dict[str, Any], now: float) -> None:
        """Fold a verified rank message into the table and emit what it changed."""
        for note in self.table.update(msg, now):
            self.emit(note.event, **note.fields)
            if note.event == "rank_hello" and note.fields["host"] == hosts.this_host():
                self.exits.watch(note.fields["rank"], note.fields["pid"])
            elif note.event in ("rank_error", "rank_peer_lost"):
                self.error_at.setdefault(note.fields["rank"], now)
        if msg["kind"] == "phase" and msg["phase"] == "standby":
            prepared, cpu_s = msg.get("prepared"), msg.get("cpu_s")
            if isinstance(prepared, str) and msg["rank"] == 0:
                self.prepared = prepared[:200]
            if cpu_s is not None:  # validated with the message (contracts.messages)
                self.cpu_s[msg["rank"]] = float(cpu_s)

    async def until_finding(
        self, running: Running, on_quiet_check: Callable[[float], None]
    ) -> tuple[Finding, float]:
        """Judge liveness and progress every check_s; return the first finding and when it was
        made (a rank gone is said at once; a hang or no progress is the caller's to say, once
        the stacks are in). `on_quiet_check(now)` after each check that found nothing."""
        heartbeat, table = self.heartbeat, self.table
        period = liveness.judge_period(table.world, heartbeat.check_s)
        last_refresh, refresh_every = 0.0, subreaper.tree_refresh_s()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self.exits.check(now)
            finding = table.judge(now, heartbeat, limits=table.limits)
            # With relays a check looks at nodes, not ranks: the period follows.
            period = liveness.judge_period(table.judged, heartbeat.check_s)
            if finding is not None:
                if finding.kind == "rank_exit":
                    self.emit(finding.kind, **attempt_events.finding_fields(finding, now))
                return finding, now
            on_quiet_check(now)
            if now - last_refresh > refresh_every:
                last_refresh = now
                running.refresh(self.exits.pids())
            self._maybe_progress(now)

    async def until_lost(self, running: Running) -> str:
        """Watch a started standby until it is lost; return why. Sets `ready_at` (and emits
        `standby_ready`) once every rank waits."""
        heartbeat, table = self.heartbeat, self.table
        exit_task = asyncio.create_task(running.wait())
        period = liveness.judge_period(table.world, heartbeat.check_s)
        last_refresh, refresh_every = 0.0, subreaper.tree_refresh_s()
        try:
            while True:
                await asyncio.wait({exit_task}, timeout=period)
                if exit_task.done():
                    rc = exit_task.result().returncode
                    return f"its ranks exited ({exits.describe_returncode(rc)})"
                now = time.monotonic()
                self.exits.check(now)
                finding = table.judge(now, heartbeat, waiting=True)
                if finding is not None:
                    return f"{finding.kind}: {finding.reason}"
                if self.ready_at is None and standby_rules.standby_ready(table.ranks, table.world):
                    self.ready_at = now
                    self.emit(
                        "standby_ready",
                        seconds=round(now - table.launched_at, 6),
                        prepared=self.prepared,
                        cpu_s=max(self.cpu_s.values(), default=None),
                    )
                if now - last_refresh > refresh_every:
                    last_refresh = now
                    running.refresh(self.exits.pids())
        finally:
            exit_task.cancel()

    def _maybe_progress(self, now: float) -> None:
        t = self.table
        if now - self._last_progress_event >= PROGRESS_EVERY_S and t.max_step is not None:
            self._last_progress_event = now
            self.emit("progress", step=t.max_step, ckpt_complete=t.ckpt_complete)
