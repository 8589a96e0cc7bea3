"""The memory tier's checksums: each tensor's bytes as a digest of CRC-32s of page sums, and the
record's own CRC-32 (what each catches and misses: the package docstring).

Pure functions of bytes and records; the slot file, the copy and the readers call them.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import torch

# The data's checksum: one digest per chunk (verified, then copied out, while in the cache).
CHECK_ALGO = "page-sums-crc32"
CHECK_CHUNK = 4 << 20
PAGE_BYTES = 4096
_HEX = re.compile(r"[0-9a-f]*")


def page_sums_crc(data: torch.Tensor, crc: int = 0) -> int:
    """`crc` carried over `data`'s 4 KiB page sums (each page's little-endian 64-bit words added
    mod 2**64; a last partial page counts as zero-padded). `data`: host uint8, whole pages but
    at its end. One pass at memory speed (a torch reduction); a changed word changes its sum."""
    data = data.detach()
    n = data.numel()
    whole = n - n % PAGE_BYTES
    if whole:
        pages = data[:whole]
        try:
            words = pages.view(torch.int64)
        except RuntimeError:  # not on an 8-byte boundary: an aligned copy
            words = pages.clone().view(torch.int64)
        crc = zlib.crc32(words.view(-1, PAGE_BYTES // 8).sum(dim=1).numpy(), crc)
    if whole < n:
        page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        page[: n - whole] = data[whole:]
        crc = zlib.crc32(page.view(torch.int64).sum().reshape(1).numpy(), crc)
    return crc


def digest(data: torch.Tensor) -> str:
    """A tensor's checksum (`data`: its bytes, host uint8): one CRC-32 of page sums
    (`page_sums_crc`) per CHECK_CHUNK bytes, 8 hex digits each."""
    n = data.numel()
    return "".join(
        f"{page_sums_crc(data[o : o + CHECK_CHUNK]):08x}" for o in range(0, n, CHECK_CHUNK)
    )


def digest_of_sums(sums) -> str:
    """`digest` of a tensor's bytes from their page sums, taken as they were copied
    (`slot_copy`): `sums` holds one int64 per 4 KiB page of the tensor, its last page's sum
    that of its zero-padded bytes; each CHECK_CHUNK's CRC-32 of its pages' sums."""
    per = CHECK_CHUNK // PAGE_BYTES
    return "".join(f"{zlib.crc32(sums[i : i + per]):08x}" for i in range(0, len(sums), per))


def digest_problem(value: Any, nbytes: int) -> str | None:
    """Pure: why `value` cannot be the digest of `nbytes` bytes (None: it can)."""
    if not isinstance(value, str) or len(value) != 8 * -(-nbytes // CHECK_CHUNK):
        return f"its checksum does not cover its {nbytes} bytes"
    if not _HEX.fullmatch(value):
        return "its checksum is not hexadecimal"
    return None


def _canonical(record: dict[str, Any]) -> bytes:
    """The record's bytes for its CRC: all of it but that CRC (`check.record`), keys sorted."""
    check = record.get("check")
    body = {**record, "check": {k: v for k, v in check.items() if k != "record"}}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def checked(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as it is written: JSON through and through (it reads back the same), with its
    `check`: the checksum's kind and the CRC-32 of the whole record but that CRC (the tensors'
    digests are in the table)."""
    plain = json.loads(json.dumps(record))
    plain["check"] = {"algo": CHECK_ALGO, "chunk_bytes": CHECK_CHUNK}
    plain["check"]["record"] = zlib.crc32(_canonical(plain))
    return plain


def record_problem(record: dict[str, Any]) -> str | None:
    """Pure: why a slot's record is not as it was written (None: it is)."""
    check = record.get("check")
    if not isinstance(check, dict):
        return "its record has no checksum"
    if check.get("algo") != CHECK_ALGO or check.get("chunk_bytes") != CHECK_CHUNK:
        return f"checksum {check.get('algo')!r} of {check.get('chunk_bytes')!r} bytes unknown"
    if check.get("record") != zlib.crc32(_canonical(record)):
        return "its record fails its checksum (changed since it was written)"
    return None


def table_problem(table: dict[str, Any], nbytes: int) -> str | None:
    """Pure: what in a slot's table points outside its `nbytes` of data (None: nothing)."""
    for key, entry in table.items():
        if not isinstance(entry, dict):
            return f"entry {key!r} is not a record"
        if "offset" not in entry:
            continue
        offset, size = entry.get("offset"), entry.get("nbytes")
        if not (isinstance(offset, int) and isinstance(size, int)):
            return f"entry {key!r} has no integer offset and size"
        if offset < 0 or size < 0 or offset + size > nbytes:
            return f"entry {key!r} lies outside the slot ({offset}+{size} > {nbytes})"
        unchecked = digest_problem(entry.get("digest"), size)
        if unchecked:
            return f"entry {key!r}: {unchecked}"
    return None
