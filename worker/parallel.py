"""One DeviceMesh for the job, and the FSDP2 / HSDP / FSDP+TP layouts applied on it.

Mesh dimensions, outermost first: `dp_replicate` (HSDP replicas), `dp_shard` (FSDP), `tp`.
Dimensions of size 1 are left out, so a plain FSDP job has a 1-D mesh.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from worker.layout import Layout
from worker.step_clock import CLOCK, timed_collectives


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    names, sizes = zip(*layout.dims(), strict=True)
    return init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = [n for n in mesh.mesh_dim_names if n in ("dp_replicate", "dp_shard")]
    if not names:  # tp only: FSDP over a group of one
        return mesh["tp"]
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def parallelize(model: nn.Module, mesh: DeviceMesh, layout: Layout) -> nn.Module:
    """Tensor-parallel the blocks (column-wise in, row-wise out), then FSDP2 each block and
    the root over the data-parallel dimensions (2-D mesh for HSDP: replicate x shard)."""
    if layout.tp > 1:
        for block in model.layers:
            parallelize_module(block, mesh["tp"], TP_PLAN)
    dp_mesh = _dp_mesh(mesh) if layout.tp == 1 or layout.dp > 1 else None
    if dp_mesh is None:
        return model
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if mesh.device_type == "cpu":  # gloo: each rank's wait in collectives, timed (step_clock)
        for part in (*model.layers, model):
            timed_collectives(part)
    return model


def materialize(model: nn.Module, device: torch.device, draw: bool = True) -> None:
    """Allocate a model built on the meta device (whole, or only this rank's shards once
    sharded), then give every parameter and buffer its initial value; without `draw`, the
    parameters are zeros (a checkpoint's load is to set them: worker.build.defers_init)."""
    model.to_empty(device=device)
    if draw:
        model.init_weights()
        return
    model.init_buffers()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for parameters on several meshes (FSDP+TP: the blocks live on
    the 2-D mesh, embeddings and norms on the data-parallel one): one norm per mesh, combined."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    local = [torch.nn.utils.get_total_norm(grads, 2.0) for grads in groups.values()]
    with CLOCK.waiting():  # the norms' all-reduces: time in collectives (step_clock)
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in local]
        total = torch.linalg.vector_norm(torch.stack(norms))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = local_part(p.grad)
        grad.mul_(scale.to(grad.device))
    return total


def local_part(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's own elements of `t` (a DTensor's local shard; a plain tensor, or None, as it
    is): what a rank can read or change without a collective."""
    return t.to_local() if hasattr(t, "to_local") else t
