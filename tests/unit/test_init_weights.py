"""Both model builds allocate on `to_empty` and rely on `init_weights` for every value: a tensor
it missed would train from whatever the memory held."""

from __future__ import annotations

import math

import torch

from worker.model import Transformer
from worker.presets import resolve_config


def test_init_weights_sets_every_parameter_and_buffer():
    cfg = resolve_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                         vocab_size=64, seq_len=16)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for t in tensors.values():
            t.fill_(math.nan)
    torch.manual_seed(0)
    model.init_weights()
    for name, t in tensors.items():
        assert torch.isfinite(t).all(), name
