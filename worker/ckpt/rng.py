"""Every random generator's state, as a checkpoint's `meta.json` holds it (one record per rank):
a resumed run draws what the uninterrupted one would have drawn.

The record is plain JSON (tensor states as base64 bytes, numpy's and python's as numbers): a
checkpoint is read, never run. Records of older checkpoints (a base64 pickle) are read through
`safe_load.legacy_rng`.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from worker.ckpt import safe_load

FORMAT = "rng-json-1"
_TENSOR_STATES = ("torch", "cuda", "xpu")


def capture(device_type: str) -> dict[str, Any]:
    return to_json(states(device_type))


def restore(record: dict[str, Any] | str, where: str = "meta.json") -> None:
    set_states(parse(record, where))


def to_json(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"format": FORMAT}
    for name in _TENSOR_STATES:
        if name in state:
            out[name] = base64.b64encode(state[name].numpy().tobytes()).decode()
    kind, keys, pos, has_gauss, cached = state["numpy"]
    out["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    version, internal, gauss_next = state["python"]
    out["python"] = [version, list(internal), gauss_next]
    return out


def parse(record: dict[str, Any] | str, where: str = "meta.json") -> dict[str, Any]:
    """The generator states of one rank's record; UnsafeCheckpoint when it is not one."""
    if isinstance(record, str):
        return safe_load.legacy_rng(record, where)
    try:
        if record.get("format") != FORMAT:
            raise ValueError(f"unknown format {record.get('format')!r}")
        state: dict[str, Any] = {}
        for name in _TENSOR_STATES:
            if name in record:
                raw = base64.b64decode(record[name], validate=True)
                state[name] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        kind, keys, pos, has_gauss, cached = record["numpy"]
        state["numpy"] = (
            str(kind),
            np.array(keys, dtype=np.uint32),
            int(pos),
            int(has_gauss),
            float(cached),
        )
        version, internal, gauss_next = record["python"]
        state["python"] = (int(version), tuple(int(k) for k in internal), gauss_next)
        if gauss_next is not None and not isinstance(gauss_next, float):
            raise ValueError("python gauss_next is not a number")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        why = f"{where}: rng is not a generator record ({exc})"
        raise safe_load.UnsafeCheckpoint(why) from None
    return state


def states(device_type: str) -> dict[str, Any]:
    """Every generator's state now (torch CPU, python, numpy, and the accelerator's)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if device_type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    elif device_type == "xpu":
        state["xpu"] = torch.xpu.get_rng_state()
    return state


def set_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if "xpu" in state:
        torch.xpu.set_rng_state(state["xpu"])
