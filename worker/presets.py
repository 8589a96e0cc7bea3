"""Model sizes: the presets and their overrides. Torch-free, so the supervisor can check a
config's `[worker]` flags without importing torch."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        kv_dim = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        mlp = 3 * self.dim * self.ffn_dim
        block = attention + mlp + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim

    def fingerprint(self) -> str:
        """Identifies the architecture a checkpoint belongs to (sequence length excluded:
        it changes no parameter)."""
        fields = {k: v for k, v in asdict(self).items() if k != "seq_len"}
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        return (
            f"dim={self.dim} n_layers={self.n_layers} n_heads={self.n_heads} "
            f"n_kv_heads={self.n_kv_heads} ffn_dim={self.ffn_dim} vocab_size={self.vocab_size}"
        )


PRESETS: dict[str, ModelConfig] = {
    "debug": ModelConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=32000, seq_len=256
    ),
    "agpt-2b": ModelConfig(
        dim=2048,
        n_layers=12,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=11008,
        vocab_size=256128,
        seq_len=8192,
        rope_theta=50000.0,
    ),
    "agpt-20b": ModelConfig(
        dim=5120,
        n_layers=64,
        n_heads=40,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=256128,
        seq_len=2048,
        rope_theta=500000.0,
    ),
}


def resolve_config(preset: str, **overrides: int | None) -> ModelConfig:
    """A preset with the flags that were given laid over it."""
    if preset not in PRESETS:
        raise KeyError(preset)
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(PRESETS[preset], **given)
