"""What the memory tier's unit tests share: a small model one update in (the optimizer holds
state to copy), and a tier on CPU without a process group."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.ckpt import memory, rng
from worker.hooks import Hooks

EXPECT = memory.Expect(
    job="j1", rank=0, world=1, mesh="dp_shard=1", model_fingerprint="abc", host="node0"
)


def trained_linear() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 700)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    optimizer.step()
    return model, optimizer


def cpu_tier(
    directory: Path, model: torch.nn.Module, optimizer, expect: memory.Expect = EXPECT
) -> memory.MemoryTier:
    """A tier copying every step; the collective fit check (it needs a process group) passed."""

    def describe(step, tokens, data, gather=False):
        return {"step": step, "tokens_seen": tokens, "data": data,
                "scheduler": {"last_epoch": step}, "rng": rng.capture("cpu")}  # fmt: skip

    t = memory.MemoryTier(directory, expect, interval=1, local_world=1, model=model,
                          optimizer=optimizer, describe=describe, hooks=Hooks())  # fmt: skip
    t.fit_checked = True
    return t


class Scheduler:
    """What a load hands the scheduler's state to."""

    def load_state_dict(self, state):
        self.state = state
