"""Whole rank lines out of MPICH Hydra's `-prepend-rank` output."""

from __future__ import annotations

import re

_HYDRA_PREFIX = re.compile(rb"\[(\d+)\] ")


class HydraLines:
    """Whole lines out of Hydra's `-prepend-rank` stream. Hydra prefixes every chunk a rank
    writes, not every line, so a rank that writes half a line at a time makes `[1] abc[1] def`,
    and other ranks' chunks land in between. Each rank's pieces are joined until its newline."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.pending: dict[bytes, bytearray] = {}

    def feed(self, raw: bytes) -> list[bytes]:
        """One line as read from the launcher; the whole lines it completes, prefixed."""
        marks = [m for m in _HYDRA_PREFIX.finditer(raw) if int(m.group(1)) < self.world]
        if not marks or marks[0].start() != 0:
            return [raw]  # the launcher's own words
        out: list[bytes] = []
        for m, nxt in zip(marks, [*marks[1:], None], strict=True):
            rank = m.group(1)
            buf = self.pending.setdefault(rank, bytearray())
            buf += raw[m.end() : nxt.start() if nxt else len(raw)]
            while b"\n" in buf:
                line, _, rest = bytes(buf).partition(b"\n")
                out.append(b"[" + rank + b"] " + line + b"\n")
                buf[:] = rest
        return out

    def flush(self) -> list[bytes]:
        """What ranks wrote without a final newline, once the stream ended."""
        out = [b"[" + r + b"] " + bytes(b) + b"\n" for r, b in self.pending.items() if b]
        self.pending.clear()
        return out
