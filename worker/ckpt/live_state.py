"""The live training state a load writes into: the optimizer's moments made to exist, and
whether the state dict's tensors are the parameters' own (loaded in place)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def prefill_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter zeroed Adam moments so DCP sees the shapes to load into; a dummy
    optimizer step would compute a whole update only to throw it away. Zeroed, not empty: the
    load then reads into pages already faulted in here, which is cheaper than faulting them in
    inside the read (0.10 s against 0.15 s for 160 MB, measured here)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in optimizer.state:
                continue
            optimizer.state[param] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }


def loaded_in_place(model: torch.nn.Module, model_sd: dict[str, Any]) -> bool:
    """DCP loads into the state dict's tensors; with FSDP2 on one device those are the
    parameters' own shards, and setting the state dict again would copy every byte onto
    itself (50 ms of a 300 MB load here)."""
    live = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, value in model_sd.items():
        mine = live.get(name)
        if mine is None or _local(mine).data_ptr() != _local(value).data_ptr():
            return False
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
