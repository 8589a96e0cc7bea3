"""agpt: a llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Module names (attention.wq, feed_forward.w1, ...) are what the tensor-parallel plan in
`worker.parallel` addresses. Heads are counted from the local projection width, so the same
code runs whole or with its heads split across tensor-parallel ranks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


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


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); rotates interleaved pairs."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos = cos[None, : x.shape[1], None, :]
    sin = sin[None, : x.shape[1], None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic under the caller's seed; also valid on sharded (DTensor) parameters,
        which is how a meta-device model gets its values after `to_empty`."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        depth_std = 0.02 / (2 * self.cfg.n_layers) ** 0.5
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        for layer in self.layers:
            for norm in (layer.attention_norm, layer.ffn_norm):
                nn.init.ones_(norm.weight)
            for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                nn.init.normal_(linear.weight, std=0.02)
            nn.init.normal_(layer.feed_forward.w1.weight, std=0.02)
            nn.init.normal_(layer.feed_forward.w3.weight, std=0.02)
            nn.init.normal_(layer.attention.wo.weight, std=depth_std)
            nn.init.normal_(layer.feed_forward.w2.weight, std=depth_std)
        nn.init.ones_(self.norm.weight)
        nn.init.normal_(self.output.weight, std=self.cfg.dim**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))
