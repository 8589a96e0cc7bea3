"""Small values between ranks as JSON bytes in tensors.

torch's `*_object` collectives pickle what one rank sends and unpickle it on the others: a
message from a peer could then run code. These send JSON text instead (a record, a path, a
table of checksums), so what a rank receives is data and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def group_device() -> torch.device:
    """Where the default process group's collectives take their tensors (NCCL: this rank's
    GPU; XCCL/oneCCL: its XPU; gloo: the host)."""
    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend in ("xccl", "ccl"):
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def all_true(flag: bool) -> bool:
    """Whether `flag` holds on every rank (one all-reduce of a number)."""
    value = torch.tensor([int(flag)], dtype=torch.int64, device=group_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value[0])


def broadcast_json(value: Any, src: int = 0) -> Any:
    """`value` of rank `src`, on every rank."""
    device = group_device()
    raw = _encode(value) if dist.get_rank() == src else b""
    size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    data = _padded(raw, int(size.item()), device)
    dist.broadcast(data, src=src)
    return _decode(data, len(data))


def all_gather_json(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    world, device = dist.get_world_size(), group_device()
    raw = _encode(value)
    size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    data = _padded(raw, max(lengths), device)
    every = [torch.empty_like(data) for _ in range(world)]
    dist.all_gather(every, data)
    return [_decode(d, n) for d, n in zip(every, lengths, strict=True)]


def gather_json(value: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's `value`, in rank order, on rank `dst` (None on the others): only `dst`
    receives the world's bytes."""
    world, device = dist.get_world_size(), group_device()
    raw = _encode(value)
    size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    longest = size.clone()
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    data = _padded(raw, int(longest.item()), device)
    here = dist.get_rank() == dst
    sizes = [torch.empty_like(size) for _ in range(world)] if here else None
    every = [torch.empty_like(data) for _ in range(world)] if here else None
    dist.gather(size, sizes, dst=dst)
    dist.gather(data, every, dst=dst)
    if not here:
        return None
    return [_decode(d, int(s.item())) for d, s in zip(every, sizes, strict=True)]


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _padded(raw: bytes, length: int, device: torch.device) -> torch.Tensor:
    data = torch.zeros(length, dtype=torch.uint8)
    if raw:
        data[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return data.to(device)


def _decode(data: torch.Tensor, length: int) -> Any:
    return json.loads(bytes(data[:length].cpu().numpy()))
