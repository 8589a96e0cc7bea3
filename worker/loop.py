"""The training loop: one step after another until the last step or a stop every rank agrees on.

Imported once, by `worker.train.main`, after the flags are checked: everything torch is
imported from here, and the time that takes is `startup/imports`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch.distributed as dist
import torch.nn.functional as F

from contracts.intervals import DURABLE, MEMORY
from worker import guard_recover, guard_step, lease
from worker.args import TrainArgs
from worker.beat import Beacon
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
from worker.step_clock import CLOCK
from worker.step_commands import StepFaults


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
    t.intervals.begin(step + 1)
    said_startup = False
    while step < args.train_iters:
        step += 1
        lease.guard()  # a fenced rank takes no step
        started = time.perf_counter()
        CLOCK.start()
        t.hooks.in_step(step)
        in_step_faults.apply()
        t.guard.pending += in_step_faults.numeric()
        for tier, every, from_step in in_step_faults.intervals():  # the supervisor's word
            t.intervals.told(tier, every, from_step)
        done = train_step(t, step, stop_requested())
        if done.verdict is not None:  # not applied: skipped, or rolled back to a checkpoint
            step, tokens_seen = guard_recover.recover(t, step, done, tokens_seen)
            continue
        mean_loss, stopping = done.mean_loss, done.stopping
        tokens_seen += t.tokens_per_step
        dt = time.perf_counter() - started
        if not said_startup:
            said_startup = True
            report_startup(t)
        report_timing(t, step)
        report_intervals(t, step, dt)
        report_step(t, step, mean_loss, dt)
        t.ckpt.poll(step)
        # the memory tier serves a relaunch: none at the last step or a stop
        if not stopping and step < args.train_iters and t.intervals.due(MEMORY, step):
            t.ckpt.save_memory(step, tokens_seen, t.data_position(step))
        if save_due(args, t.intervals.due(DURABLE, step), step, stopping):
            t.ckpt.save(step, tokens_seen, t.data_position(step))
        if stopping:
            say(f"stop requested: exiting after step {step}", flush=True)
            break
    finish(t, step)
    return 0


def train_step(t: Training, step: int, stop_requested: bool) -> guard_step.Stepped:
    """Forward, backward, clip; the agreement, which the numerical guard judges the step by;
    the update unless the step is bad (worker.guard_step)."""
    due = t.guard.due(step)  # faults injected into this rank, if any
    inputs, targets = batch(t.source, t.guard.position(step), t.dp_rank, t.args.batch_size)
    logits = t.model(inputs.to(t.device))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.to(t.device).flatten())
    if due.factor != 1.0:
        loss = loss * due.factor
    loss.backward()
    params = [p for p in t.model.parameters() if p.grad is not None]
    if due.poison:
        guard_step.poison(params)
    if due.applied or due.late:  # the supervisor's `fault` event waits for the rank's word
        guard_step.say_injected(t.beacon, due, step)
    local = guard_step.local_norm(params) if t.guard.cfg.on else 0.0
    grad_norm = clip_grad_norm(params, t.args.grad_clip).item()
    t.ckpt.before_update()  # a save's staging copy ran beside forward and backward
    mean_loss, stopping, nonfinite, said = agree(
        loss.item(), local, stop_requested, t.info.world, t.device, t.intervals.offer(step)
    )
    t.intervals.agreed(said)  # rank 0's intervals, from this step on every rank
    verdict = t.guard.judge(mean_loss, grad_norm, nonfinite)
    t.metrics.add_to_next("train/grad_norm", grad_norm)
    if verdict is None:
        t.optimizer.step()
        t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)  # a bad step's gradients go with them
    return guard_step.Stepped(loss.item(), local, mean_loss, stopping, verdict)


def agree(
    loss: float,
    local_grad: float,
    stop_requested: bool,
    world: int,
    device=None,
    intervals: Sequence[float] = (),
) -> tuple[float, bool, int, list[float]]:
    """The stop agreement: one small all-reduce carries the mean loss, whether any rank was
    asked to stop, so every rank stops after the same step, how many ranks hold a non-finite
    loss or gradient (the guard's; the mean is then NaN on every rank), and the checkpoint
    intervals (rank 0's, the others give 0: worker.intervals), so that every rank copies and
    saves at the same steps. On the training device: nccl reduces no CPU tensor."""
    shared = guard_step.shared_values(loss, local_grad, stop_requested, device, intervals)
    with CLOCK.waiting():
        dist.all_reduce(shared)
    return (*guard_step.agreed(shared, world), shared[3:].tolist())


def save_due(args: TrainArgs, periodic: bool, step: int, stopping: bool) -> bool:
    """At the steps the durable interval says (`periodic`: worker.intervals); with
    `--save-on-exit` also at the last step and at a stop."""
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


def report_intervals(t: Training, step: int, dt: float) -> None:
    """What the copies and saves since the last step cost it, for the intervals' tuning (rank 0
    tells the supervisor too, on its step message); an interval changed goes on the metrics
    record."""
    costs = t.intervals.after_step(step, dt, t.ckpt.take_costs())  # the samples
    if costs and t.info.rank == 0:
        t.beacon.costs(costs)
    for tier, every in t.intervals.take_changed().items():
        t.metrics.set_on_next(INTERVAL_METRIC[tier], every)


INTERVAL_METRIC = {MEMORY: "train/mem_ckpt_interval", DURABLE: "train/save_interval"}


def report_step(t: Training, step: int, mean_loss: float, dt: float) -> None:
    entry = t.metrics.record(step, mean_loss, dt, t.tokens_per_step)
    t.beacon.step(step, mean_loss, dt)
    if step % t.args.log_every == 0 or step == t.args.train_iters:
        t.say(human_line(entry, t.args.train_iters), flush=True)


def report_timing(t: Training, step: int) -> None:
    """The step's compute and wait in collectives (worker.step_clock): the beacon carries them
    to the supervisor's straggler score."""
    compute, wait = CLOCK.split()
    t.beacon.timing(compute, wait)
    t.metrics.add_to_next("train/compute_seconds", compute)
    t.metrics.add_to_next("train/wait_seconds", wait)


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
