"""Batches that are a pure function of (seed, data position, sample index).

The data position of step s is s unless the run skips positions (worker.guard: `--skip-batches`,
the numerical guard); the `step` below is that position.

Sample i of the global batch at step s comes from a generator seeded by (seed, s, i); a
data-parallel rank takes its own slice of the global batch. A resumed run therefore sees exactly
the batches the uninterrupted run saw, without replaying any, and a single process given the
whole global batch sees what all data-parallel ranks see together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from worker.errors import UsageError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def _sample_rng(seed: int, step: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, step, index])


@dataclass(frozen=True)
class SyntheticData:
    """Learnable sequences: each sample walks the vocabulary with its own start and stride,
    with a few noise tokens, so the loss has somewhere to fall."""

    vocab_size: int
    seq_len: int
    seed: int
    noise: float = 0.05

    def sample(self, step: int, index: int) -> np.ndarray:
        rng = _sample_rng(self.seed, step, index)
        start = rng.integers(self.vocab_size)
        stride = rng.integers(1, 8)
        tokens = (start + stride * np.arange(self.seq_len + 1)) % self.vocab_size
        noisy = rng.random(self.seq_len + 1) < self.noise
        tokens[noisy] = rng.integers(self.vocab_size, size=int(noisy.sum()))
        return tokens.astype(np.int64)


class TokenFileData:
    """A flat binary file of token ids (uint16 or uint32), memory-mapped; each sample is a
    window at an offset drawn from the sample's own generator."""

    def __init__(self, path: str, dtype: str, vocab_size: int, seq_len: int, seed: int):
        file = Path(path)
        if not file.is_file():
            raise UsageError(
                f"token file {path} does not exist; pass --data-path to a file of {dtype} token ids"
            )
        self.tokens = np.memmap(file, dtype=TOKEN_DTYPES[dtype], mode="r")
        if len(self.tokens) <= seq_len + 1:
            raise UsageError(
                f"token file {path} holds {len(self.tokens)} tokens; "
                f"need more than --seq-len + 1 = {seq_len + 1}"
            )
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def sample(self, step: int, index: int) -> np.ndarray:
        rng = _sample_rng(self.seed, step, index)
        offset = int(rng.integers(len(self.tokens) - self.seq_len - 1))
        window = np.asarray(self.tokens[offset : offset + self.seq_len + 1], dtype=np.int64)
        return window % self.vocab_size


def batch(source, step: int, dp_rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's (inputs, targets) for `step`."""
    first = dp_rank * batch_size
    rows = np.stack([source.sample(step, first + i) for i in range(batch_size)])
    tokens = torch.from_numpy(rows)
    return tokens[:, :-1], tokens[:, 1:]
