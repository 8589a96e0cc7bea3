"""The training loop's side of async checkpoints: metrics, heartbeats and log lines around an
`AsyncCheckpointer`, so that the loop itself only calls `save`, `before_update`, `poll` and
`finish`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from supervisor.protocol import ENV_JOB_ID
from worker.ckpt.async_save import (
    AsyncCheckpointer,
    KillHook,
    PollReport,
    Readiness,
    default_stage_root,
)


class AsyncSaves:
    def __init__(self, args, info, ckpt, metrics, beacon, say):
        stage_root = (
            Path(args.ckpt_stage_dir)
            if args.ckpt_stage_dir
            else default_stage_root(args.ckpt_dir, os.environ.get(ENV_JOB_ID))
        )
        hook = KillHook(
            phase=args.inject_kill_async_phase,
            step=args.inject_kill_in_save_at_step,
            armed=info.rank == args.inject_rank,
            delay_s=args.inject_ckpt_delay_s,
        )
        self.saver = AsyncCheckpointer(
            ckpt,
            stage_root=stage_root,
            local_rank=info.local_rank,
            timeout_s=args.pg_timeout,
            hook=hook,
        )
        self.metrics, self.beacon, self.say = metrics, beacon, say
        self.step = 0
        self.handover_seconds = 0.0

    def save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        self.step = step
        report = self.saver.save(step, tokens_seen, data)
        self._handle(report.drained)
        self.handover_seconds = report.call_seconds
        if report.drained:
            self.metrics.add_to_next("train/ckpt_wait_seconds", report.wait_seconds)

    def before_update(self) -> None:
        """Before the optimizer step: the save in flight must have copied the state."""
        staged = self.saver.wait_staged()
        if staged is None:
            return
        stall = self.handover_seconds + staged.wait_seconds
        self.metrics.add_to_next("train/ckpt_stage_seconds", stall)
        self.metrics.add_to_next("train/ckpt_stage_copy_seconds", staged.copy_seconds)
        self.beacon.ckpt(staged.step, "staged")
        self.say(
            f"checkpoint step={staged.step} staged ({staged.nbytes / 2**20:.1f} MiB, copy "
            f"{staged.copy_seconds:.3f}s beside training), loop blocked {stall:.3f}s",
            flush=True,
        )

    def poll(self, step: int) -> None:
        self.step = step
        report = self.saver.poll()
        if report is not None:
            self._handle([report])

    def finish(self, step: int) -> None:
        self.step = step
        self._handle(self.saver.drain())
        self.saver.close()

    def _handle(self, reports: list[PollReport]) -> None:
        for r in reports:
            if r.written:
                self.beacon.ckpt(r.step, "written")
            if r.state is Readiness.READY:
                self.metrics.add_to_next("train/ckpt_drain_seconds", r.drain_seconds)
                self.metrics.add_to_next("train/ckpt_marker_seconds", r.save_to_marker_seconds)
                self.beacon.ckpt(r.step, "complete")
                self.say(
                    f"checkpoint step={r.step} complete at step={self.step} "
                    f"({r.save_to_marker_seconds:.2f}s after the save, "
                    f"drain {r.drain_seconds:.3f}s)",
                    flush=True,
                )
            elif r.state is Readiness.FAILED:
                self.say(f"WARNING: checkpoint step={r.step} failed: {r.error}", flush=True)
