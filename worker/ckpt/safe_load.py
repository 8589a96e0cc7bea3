"""Reading a checkpoint never runs code from it.

Checkpoints lie on shared file systems that whole project groups can write, and a pickle can call
anything. Three things in a checkpoint were unpickled: DCP's `.metadata`, DCP's byte records
(optimizer hyper-parameters and other non-tensor state) and, in checkpoints written before the
RNG states moved to plain JSON, `meta.json`'s `rng` entries. Each is now read by an unpickler
that admits only what DCP (or the old RNG record) writes: the metadata classes, torch sizes and
dtypes, tensors through torch's own `weights_only` loader. Anything else is refused with an
`UnsafeCheckpoint` naming the file, and resume treats that checkpoint as damaged.
"""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds something other than what a checkpoint holds."""


# What DCP's `.metadata` pickle refers to (torch 2.x), beyond plain containers and numbers.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip


def _tensor_from_bytes(data: bytes) -> Any:
    """A pickled storage, through torch's own restricted (`weights_only`) loader."""
    return torch.load(io.BytesIO(data), weights_only=True)


# The RNG record of older checkpoints: pickled torch and numpy states.
_LEGACY_RNG = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _tensor_from_bytes,
    ("collections", "OrderedDict"): None,
    ("numpy._core.multiarray", "_reconstruct"): None,
    ("numpy.core.multiarray", "_reconstruct"): None,
    ("numpy", "ndarray"): None,
    ("numpy", "dtype"): None,
}


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            replacement = self.allowed[(module, name)]
            return replacement if replacement is not None else super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which no checkpoint holds")


def _restricted_load(data: bytes, allowed: dict[tuple[str, str], Any], what: str) -> Any:
    try:
        return _Restricted(data, allowed).load()
    except Exception as exc:  # any failure of a crafted or torn pickle is a refusal
        raise UnsafeCheckpoint(f"{what}: {exc}") from None


def load_metadata(path: Path) -> dcp_md.Metadata:
    """DCP's `.metadata`, admitting only DCP's own classes."""
    allowed = dict.fromkeys(_METADATA_CLASSES)
    md = _restricted_load(path.read_bytes(), allowed, str(path))
    if not isinstance(md, dcp_md.Metadata):
        raise UnsafeCheckpoint(f"{path}: not DCP metadata ({type(md).__name__})")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = dcp_md.StorageMeta()
    return md


def legacy_rng(text: str, where: str) -> dict[str, Any]:
    """The RNG states of a checkpoint written before they were JSON (base64 of a pickle)."""
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise UnsafeCheckpoint(f"{where}: rng is not base64 ({exc})") from None
    state = _restricted_load(data, _LEGACY_RNG, where)
    if not isinstance(state, dict) or not {"torch", "numpy", "python"} <= state.keys():
        raise UnsafeCheckpoint(f"{where}: rng is not a record of random generator states")
    return state


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but byte records are read with torch's `weights_only` loader (DCP's
    own calls `torch.load(weights_only=False)` on them)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpoint(f"record {read_item.dest_index.fqn}: {exc}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
