"""The training loop: one step after another until the last step or a stop every rank agrees on.

Imported once, by `worker.train.main`, after the flags are checked: everything torch is
imported from here, and the time that takes is `startup/imports`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from worker.args import TrainArgs
from worker.beat import Beacon, StepFaults
from worker.build import Setup, Training, build
from worker.data import batch
from worker.dist import RankInfo
from worker.hooks import Hooks
from worker.layout import Layout
from worker.metrics import human_line
from worker.parallel import clip_grad_norm
from worker.presets import ModelConfig
from worker.standby import build_after_go
from worker.startup import Startup


def run(
    args: TrainArgs,
    info: RankInfo,
    cfg: ModelConfig,
    layout: Layout,
    beacon: Beacon,
    say: Callable[..., None],
    stop_requested: Callable[[], bool],
    standby: bool = False,
    hooks: Hooks | None = None,
) -> int:
    startup = Startup()
    startup.mark("imports")
    setup = Setup(args, info, cfg, layout, beacon, say, startup, hooks or Hooks())
    if not standby:
        t = build(setup)
    else:
        t = build_after_go(setup, stop_requested)
        if t is None:  # told to exit (or stopped) before it trained: nothing to save or drain
            beacon.close()
            if dist.is_initialized():  # no barrier: every rank is told, none waits for another
                dist.destroy_process_group()
            return 0
    step, tokens_seen = t.start_step, t.start_tokens
    beacon.phase("train", step)
    in_step_faults = StepFaults(beacon)  # faults/: stall or slow this rank when told to
    while step < args.train_iters:
        step += 1
        started = time.perf_counter()
        t.hooks.in_step(step)
        in_step_faults.apply()
        loss = train_step(t, step)
        mean_loss, stopping = agree(loss, stop_requested(), info.world)
        tokens_seen += t.tokens_per_step
        dt = time.perf_counter() - started
        if step == t.start_step + 1:
            report_startup(t)
        report_step(t, step, mean_loss, dt)
        t.ckpt.poll(step)
        if not stopping and step < args.train_iters:  # the memory tier serves a relaunch
            t.ckpt.save_memory(step, tokens_seen, t.data_position(step))
        if save_due(args, step, stopping):
            t.ckpt.save(step, tokens_seen, t.data_position(step))
        if stopping:
            say(f"stop requested: exiting after step {step}", flush=True)
            break
    finish(t, step)
    return 0


def train_step(t: Training, step: int) -> torch.Tensor:
    """Forward, backward, clip, update. Returns this rank's loss."""
    inputs, targets = batch(t.source, step, t.dp_rank, t.args.batch_size)
    logits = t.model(inputs.to(t.device))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(t.device).flatten())
    loss.backward()
    clip_grad_norm(t.model.parameters(), t.args.grad_clip)
    t.ckpt.before_update()  # a save's staging copy ran beside forward and backward
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    return loss


def agree(loss: torch.Tensor, stop_requested: bool, world: int) -> tuple[float, bool]:
    """The stop agreement: one small all-reduce carries both the mean loss and whether any rank
    was asked to stop, so every rank stops after the same step."""
    shared = torch.tensor([loss.item(), float(stop_requested)], dtype=torch.float64)
    dist.all_reduce(shared)
    return shared[0].item() / world, shared[1].item() > 0


def save_due(args: TrainArgs, step: int, stopping: bool) -> bool:
    """Every `--save-interval` steps; with `--save-on-exit` also at the last step and at a
    stop."""
    periodic = args.save_interval > 0 and step % args.save_interval == 0
    last = step == args.train_iters
    return periodic or ((last or stopping) and args.save_on_exit)


def report_startup(t: Training) -> None:
    """On the first step's record: where the (re)start's seconds went."""
    t.startup.mark("first_step")
    for name, seconds in t.startup.parts.items():
        t.metrics.add_to_next(name, seconds)
    t.metrics.add_to_next("train/startup_seconds", t.startup.total)
    if t.startup.prepare_seconds is not None:  # a warm standby: its seconds before `go`
        t.metrics.add_to_next("train/standby_prepare_seconds", t.startup.prepare_seconds)
    if t.resumed is not None:
        t.metrics.add_to_next("train/restart_seconds", t.startup.total)
        t.beacon.resumed(t.start_step, t.startup.total, t.resumed.source, t.resumed.why)


def report_step(t: Training, step: int, mean_loss: float, dt: float) -> None:
    entry = t.metrics.record(step, mean_loss, dt, t.tokens_per_step)
    t.beacon.step(step, mean_loss, dt)
    if step % t.args.log_every == 0 or step == t.args.train_iters:
        t.say(human_line(entry, t.args.train_iters), flush=True)


def finish(t: Training, step: int) -> None:
    """Drain the checkpoints, say how the run ended, leave the process group together."""
    t.ckpt.close(step)
    t.beacon.phase("done", step)
    if step >= t.args.train_iters:
        t.beacon.done(step)
    t.metrics.close()
    t.beacon.close()
    dist.barrier()
    dist.destroy_process_group()
