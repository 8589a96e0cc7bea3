"""A warm standby (`ES_STANDBY=1`): a relaunch whose cold start is paid before the failure.

While another attempt trains, the supervisor starts the next one as a standby. It prepares all
that no checkpoint decides (interpreter and imports, its own process group, the mesh, model,
optimizer, scheduler, data, metrics, a warm-up of the gradient clip and of an update of copies),
says phase `standby` and blocks until the supervisor's signed `go` or `exit`. On `go` it resumes
exactly as a cold start does from the choice of checkpoint on, so the run computes bit for bit
the same; its restart (`train/restart_seconds`) counts from `go`. On `exit`, or SIGTERM/SIGUSR1,
it ends with 0 having trained nothing and touched no checkpoint.

What a standby holds: on CPU, the whole prepared run (process group, model, optimizer shells,
warm-up done); on an accelerator, only the imported interpreter, so that it never takes device
memory from the attempt that trains; everything else is built after `go`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
import torch.distributed as dist

from worker import priority
from worker.build import (
    Group,
    Setup,
    State,
    Training,
    build,
    build_state,
    choose,
    defers_init,
    join_group,
    resume_from,
)
from worker.ckpt import rng
from worker.dist import select_device
from worker.parallel import clip_grad_norm

ACCELERATORS = ("cuda", "xpu")
PREPARED_ON_CPU = "imports, process group, mesh, model, optimizer, warm-up of clip and update"


def build_after_go(setup: Setup, stop_requested: Callable[[], bool]) -> Training | None:
    """Prepare, wait, then build the rest once told to go; None when told to exit or stop."""
    device_type, _ = select_device(setup.args.device)  # no device touched: no context, no memory
    if device_type in ACCELERATORS:
        # Nothing that holds device memory before `go`: the cold build follows it.
        if not wait(setup, stop_requested, "imports"):
            return None
        return build(setup)
    with priority.lowest_session():  # its CPU from what the training ranks leave idle
        group = join_group(setup)
        state = build_state(setup, group, draw=not defers_init(group))  # drawn if fresh
        # In this thread: DTensor's sharding cache is per thread, a warm-up in another one
        # left the training thread's cold (the first step after `go` 0.1-0.15 s slower).
        warm_up(setup, group, state)
    if not wait(setup, stop_requested, PREPARED_ON_CPU):
        return None
    return resume_from(setup, group, state, choose(setup, group))


def wait(setup: Setup, stop_requested: Callable[[], bool], prepared: str) -> bool:
    """Say `standby` (and what is `prepared`) and block (no CPU) until `go` (True) or `exit` /
    a stop (False)."""
    startup = setup.startup
    startup.ready()
    setup.beacon.standby(prepared)
    command = setup.beacon.wait_standby_command(stop_requested)["action"]
    startup.mark("standby_wait")
    if command != "go":
        setup.say(f"standby: {command}, exiting without training", flush=True)
        return False
    waited = startup.parts["startup/standby_wait"]
    setup.say(
        f"standby: go (ready {startup.prepare_seconds:.2f}s after start, waited {waited:.2f}s)",
        flush=True,
    )
    startup.go()
    return True


def warm_up(setup: Setup, group: Group, state: State) -> None:
    """The clip and an update of copies (`warm_update`) on zero gradients, then the gradients
    dropped and every random generator as it was: the first real step's clip and update run
    warm and compute what they would have computed cold. The loop's per-step all-reduce is warmed
    too. Without tensor parallelism, what DTensor works out the first time it meets an op of a
    kind (0.2-0.3 s of CPU per rank on the debug preset) is most of what a first step has beyond
    a steady one. No forward or backward: one on a short throwaway batch (FSDP's lazy set-up,
    autograd, the all-gathers) took 0.3 s of a standby's CPU, from the ranks training beside it,
    and left the first real step no faster (`docs/benchmarks.md`, soak.py). Under tensor
    parallelism the activations are DTensors too, and what DTensor works out for their shapes
    fills on the first real step, with or without such a batch."""
    saved = rng.states(group.device_type)
    trained = [param for param in state.model.parameters() if param.requires_grad]
    for param in trained:  # shaped, strided and sharded as the reduce-scatter leaves a gradient
        param.grad = torch.zeros_like(param)
    clip_grad_norm(trained, setup.args.grad_clip)
    warm_update(state.optimizer)
    for param in trained:  # as a cold start has them: none (whether the optimizer holds it or not)
        param.grad = None
    dist.all_reduce(torch.zeros(2, dtype=torch.float64))  # as `loop.agree` does each step
    rng.set_states(saved)
    setup.startup.mark("warmup")
    gc.freeze()  # what the warm-up left for good (DTensor's caches): outside later collections


def warm_update(optimizer: torch.optim.Optimizer) -> None:
    """One step of a throwaway optimizer of the same kind and settings over copies of one
    parameter of each kind (`update_kind`), with their gradients: the ops of an update run once
    before `go`, so the first real one is a steady one (on sharded parameters DTensor works out
    each op's sharding the first time it meets it: 0.17 s of CPU per rank on the debug preset,
    measured here). One of a kind is enough for that cache, and the rest cost a standby CPU
    that the ranks training beside it need (a full copy was a third of its preparation). The
    parameters are not touched and the real optimizer keeps no state, as a cold start has
    none; the copies and their moments are dropped here."""
    groups, seen = [], set()
    for index, group in enumerate(optimizer.param_groups):
        # A foreach or fused update is one op over the group's list: only the whole list warms
        # it (on CPU the default is neither: one op per parameter).
        whole = bool(group.get("foreach") or group.get("fused"))
        copies = []
        for param in group["params"]:
            kind = (index, id(param)) if whole else (index, *update_kind(param))
            if kind in seen:
                continue
            seen.add(kind)
            copy = param.detach().clone()
            copy.grad = param.grad
            copies.append(copy)
        if copies:
            groups.append({**group, "params": copies})
    if groups:
        type(optimizer)(groups).step()


def update_kind(param: torch.Tensor) -> tuple:
    """What an update's ops, and DTensor's sharding of them, depend on: the tensor's type,
    shape, strides and dtype, its gradient's, and where a DTensor lies (mesh and placements)."""
    grad = param.grad
    return (
        type(param).__name__, tuple(param.shape), tuple(param.stride()), param.dtype,
        repr(getattr(param, "placements", None)), id(getattr(param, "device_mesh", None)),
        None if grad is None else (type(grad).__name__, tuple(grad.shape), tuple(grad.stride()),
                                   grad.dtype, repr(getattr(grad, "placements", None))),
    )  # fmt: skip
