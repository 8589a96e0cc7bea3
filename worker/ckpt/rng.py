"""Every random generator's state, as a checkpoint's `meta.json` holds it (one text per rank):
a resumed run draws what the uninterrupted one would have drawn."""

from __future__ import annotations

import base64
import pickle
import random
from typing import Any

import numpy as np
import torch


def capture(device_type: str) -> str:
    return base64.b64encode(pickle.dumps(states(device_type))).decode()


def restore(text: str) -> None:
    set_states(pickle.loads(base64.b64decode(text)))


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
