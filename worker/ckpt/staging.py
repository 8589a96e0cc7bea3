"""The async save's staging copy: this rank's state in host memory, taken on the save thread
while the next step's forward and backward run (they do not change it; the optimizer step
waits for the copy)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict
from torch.distributed.tensor import DTensor

from worker.ckpt import storage


@dataclass(frozen=True)
class Loan:
    """A staged copy lent to a writer: its state dict (views of the block), the whole padded
    slot of each of its tensors, and what to call once the writer is done with them."""

    snapshot: dict[str, Any]
    padded: Callable[[torch.Tensor], torch.Tensor | None]
    nbytes: int
    release: Callable[[], None]


class ReusedStager:
    """Copies a state dict into host buffers allocated once and reused by every save (`copy_`
    into warm pages runs at memory bandwidth; DCP's default stager allocates afresh each time
    and pays page faults). The caller must not stage again before the previous write has
    finished with the buffers."""

    def __init__(self, on_staged=lambda: None, allocate=None):
        self._cache: dict[str, Any] | None = None
        self._latest: dict[str, Any] | None = None
        self._block: torch.Tensor | None = None
        self._slots: dict[int, torch.Tensor] = {}  # data_ptr -> the padded bytes of a slot
        self._cursor = 0
        self.nbytes = 0
        self.copy_seconds = 0.0
        self._on_staged = on_staged
        # Where the block comes from: host memory by default; the memory tier maps a file.
        self._allocate_block = allocate or (
            lambda nbytes: storage.aligned_zeros(nbytes, pin=torch.cuda.is_available())
        )

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        if self._cache is None:
            self._allocate(state_dict)
        try:
            staged = _copy_state_dict(state_dict, self._cache)
        except CompanionMismatch:  # the state's structure changed: new buffers
            self._allocate(state_dict)
            staged = _copy_state_dict(state_dict, self._cache)
        self.copy_seconds = time.perf_counter() - started
        self._latest = staged
        self._on_staged()
        return staged

    def _allocate(self, state_dict: dict[str, Any]) -> None:
        """Mirror the state dict with host tensors that are views of one block, touched once
        here (page faults on the first save only; one large block also gets huge pages where
        the kernel gives them). DTensors keep their sharding spec around a host local shard.
        Every slot starts and ends on an O_DIRECT boundary, so the writer can hand each one to
        the device as it is (`padded`)."""
        block = self._allocate_block(bytes_needed(state_dict))
        self._cursor = 0
        self._slots = {}
        self._block = block
        self._cache = self._mirror(state_dict)
        self.nbytes = self._cursor

    def _take(self, like: torch.Tensor) -> torch.Tensor:
        if like.dim() == 0:
            return torch.empty((), dtype=like.dtype)
        start = self._cursor
        self._cursor += _aligned(like)
        slot = self._block[start : self._cursor]
        self._slots[slot.data_ptr()] = slot
        return slot[: like.numel() * like.element_size()].view(like.dtype).view(like.shape)

    def padded(self, t: torch.Tensor) -> torch.Tensor | None:
        """The whole slot of a staged tensor (its bytes, then padding), None for anything
        else."""
        slot = self._slots.get(t.data_ptr())
        return slot if slot is not None and t.numel() * t.element_size() <= len(slot) else None

    def _mirror(self, tree: Any) -> Any:
        if isinstance(tree, DTensor):
            return DTensor(self._take(tree._local_tensor), tree._spec, requires_grad=False)
        if isinstance(tree, torch.Tensor):
            return self._take(tree)
        if isinstance(tree, dict):
            return {k: self._mirror(v) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._mirror(v) for v in tree)
        return tree

    @property
    def staged(self) -> dict[str, Any] | None:
        """The newest staging as `stage` returned it: tensors in the block, and this staging's
        values of everything else (the mirror itself keeps those of its first)."""
        return self._latest

    def close(self) -> None:
        self._cache = self._block = self._latest = None
        self._slots = {}


def bytes_needed(state_dict: dict[str, Any]) -> int:
    """The size of the block that stages `state_dict` (every slot padded to alignment)."""
    return sum(_aligned(t) for t in _local_tensors(state_dict) if t.dim() > 0)


def _aligned(t: torch.Tensor) -> int:
    return storage.round_up(t.numel() * t.element_size())


def _local_tensors(tree: Any):
    """Every host tensor of a staged state dict (a DTensor's local shard)."""
    if isinstance(tree, torch.Tensor):
        yield tree._local_tensor if isinstance(tree, DTensor) else tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _local_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _local_tensors(v)
