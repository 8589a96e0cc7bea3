"""Partner copies on the holder's node: another rank's memory copy, received over the network,
kept as two slots of the same form as a rank's own (`<job dir>/partner/rank-<ward>/slot-<0|1>`).

A received copy is written between the two generations like a local copy: its record is checked
first (this run's, a ward of this rank, a table inside its size), then the bytes go straight
into the slot (the link receives into the mapping: no copy of its own) and the slot is sealed.
The bytes are not checked on receipt: the sealed record carries the ward's digest of every
tensor, and a fetch checks them all before anything is loaded (`partner_fetch`), so a copy
damaged on the way or at rest is refused where it would matter, and receiving costs no pass
over the bytes. A copy cut short stays torn and is never found. The sealed record is the
ward's, plus who holds it (`partner`), with the holder's own generation and a fresh record
checksum; the run identity (job, rank, world, mesh, model) is the ward's and must be this
run's, its node any.
"""

from __future__ import annotations

import re
import shutil
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from worker.ckpt.fail_points import SaveFailPoints
from worker.ckpt.memory.checksum import checked, digest, record_problem
from worker.ckpt.memory.held import Held, identity_problem, inspect
from worker.ckpt.memory.slot_file import (
    HEADER_BYTES,
    SLOTS,
    Expect,
    MappedSlot,
    SlotRefused,
    slot_paths,
)

PARTNER_DIR = "partner"
_WARD_DIR = re.compile(r"rank-(0|[1-9][0-9]{0,8})")  # as slot_file.rank_dir names it


@dataclass(frozen=True)
class Incoming:
    """A copy being received: its checked record, and the slot its bytes go into (`view`)."""

    record: dict[str, Any]
    ward: int
    slot: int
    gen: int
    view: memoryview


def partner_dir(job_dir: Path) -> Path:
    return job_dir / PARTNER_DIR


def ward_expect(expect: Expect, ward: int) -> Expect:
    """What a copy of `ward`'s state must match here: this run, that rank, any node."""
    return replace(expect, rank=ward, host=None)


def bytes_problem(table: dict[str, Any], block: torch.Tensor) -> str | None:
    """Why `block` (host uint8, a copy's data) is not the bytes its `table` describes: the first
    tensor whose bytes fail their digest; None when every one passes."""
    for key, entry in table.items():
        if "offset" not in entry:
            continue
        offset, nbytes = entry["offset"], entry["nbytes"]
        if digest(block[offset : offset + nbytes]) != entry["digest"]:
            return f"{key}: its bytes fail their checksum"
    return None


def header_problem(record: Any, expect: Expect, nbytes: int) -> str | None:
    """Why a received copy's record cannot be held (None: it can): not a sealed record of this
    run (another job, world, mesh or model), a ward that is not `expect.rank`, a table pointing
    outside its `nbytes`."""
    if not isinstance(record, dict) or not isinstance(record.get("gen"), int):
        return "no record"
    problem = record_problem(record)
    if problem:
        return problem
    if record.get("nbytes") != nbytes:
        return f"{nbytes} bytes received, its record says {record.get('nbytes')!r}"
    return identity_problem(record, expect, nbytes)


def _own_dir(path: Path) -> None:
    """`path` made (0700) if missing; OSError unless it is a directory itself (not a symlink to
    one: a copy is never written where a link points)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not stat.S_ISDIR(path.lstat().st_mode):
        raise NotADirectoryError(20, "not a directory of its own", str(path))


class PartnerStore:
    """The copies this rank holds for others (its wards: `wards`, or any rank but itself when
    None), each in two alternating slots: a new copy never goes into the slot of the newest
    complete one."""

    def __init__(
        self,
        job_dir: Path,
        expect: Expect,
        holder: int,
        node: str,
        hooks: SaveFailPoints,
        wards: set[int] | None = None,
    ):
        self.directory = partner_dir(job_dir)
        self.expect, self.holder, self.node = expect, holder, node
        self.wards = wards
        self.hooks = hooks
        self.slots: dict[tuple[int, int], MappedSlot] = {}
        self.target: dict[int, int] = {}
        self.gen: dict[int, int] = {}

    def _start(self, ward: int) -> None:
        """The first copy of `ward`: its slots, and the slot and generation after what is
        already there (a relaunch holds the previous attempt's copies)."""
        _own_dir(self.directory)
        _own_dir(self.directory / f"rank-{ward}")
        held, _ = find_ward(self.directory, ward_expect(self.expect, ward), self.holder)
        self.gen[ward] = 1 + max((h.gen for h in held), default=0)
        self.target[ward] = (held[0].slot + 1) % SLOTS if held else 0
        for s in range(SLOTS):
            self.slots[ward, s] = MappedSlot(*slot_paths(self.directory, ward, s))

    def open(self, record: Any, most: int) -> Incoming:
        """The slot a received copy goes into, torn from here until `seal`: SlotRefused naming
        why its record cannot be held (not this run's, not a ward of this rank, over `most`
        bytes)."""
        ward = record.get("rank") if isinstance(record, dict) else None
        if type(ward) is not int or ward == self.holder or not 0 <= ward < self.expect.world:
            raise SlotRefused(f"a copy of rank {str(ward)[:40]}, not one this rank holds")
        if self.wards is not None and ward not in self.wards:
            raise SlotRefused(f"a copy of rank {ward}, not one this rank holds")
        nbytes = record.get("nbytes")
        if type(nbytes) is not int or nbytes < 0:
            raise SlotRefused(f"rank {ward}'s copy: no size in its record")
        problem = header_problem(record, ward_expect(self.expect, ward), nbytes)
        if problem is None and nbytes > most:
            problem = f"{nbytes} bytes, over the {most} a copy may have"
        if problem:
            raise SlotRefused(f"rank {ward}'s copy: {problem}")
        if ward not in self.gen:
            self._start(ward)
        slot, gen = self.target[ward], self.gen[ward]
        target = self.slots[ward, slot]
        if target.block is None or target.block.numel() != nbytes:
            target.map(nbytes)
        target.begin(gen)
        self.gen[ward] += 1
        return Incoming(record, ward, slot, gen, memoryview(target.block.numpy()))

    def seal(self, incoming: Incoming, received: int) -> tuple[int, int]:
        """Seal a copy whose `received` bytes are in its slot: (ward, step); SlotRefused when
        they are not all its record's (the slot then stays torn)."""
        record, ward = incoming.record, incoming.ward
        if received != record["nbytes"]:
            raise SlotRefused(
                f"rank {ward}'s copy: {received} bytes received, its record says {record['nbytes']}"
            )
        target = self.slots[ward, incoming.slot]
        held = {**record, "gen": incoming.gen}
        held["partner"] = {"holder": self.holder, "node": self.node, "received_at": time.time()}
        target.seal(incoming.gen, checked(held))
        self.target[ward] = (incoming.slot + 1) % SLOTS
        first = min((e["offset"] for e in record["table"].values() if "offset" in e), default=0)
        self.hooks.partner_held(record["step"], target.bin_path, HEADER_BYTES + first)
        return ward, record["step"]

    def receive(self, record: Any, data: memoryview) -> tuple[int, int]:
        """Hold a copy whose bytes are at hand (`open`, the bytes copied in, `seal`)."""
        if isinstance(record, dict) and record.get("nbytes") != len(data):
            ward = record.get("rank")
            said = f"{len(data)} bytes received, its record says {record.get('nbytes')!r}"
            raise SlotRefused(f"rank {str(ward)[:40]}'s copy: {said}")
        incoming = self.open(record, len(data))
        incoming.view[:] = data
        return self.seal(incoming, len(data))

    def close(self) -> None:
        for slot in self.slots.values():
            slot.header = slot.block = None


def find_ward(directory: Path, expect: Expect, holder: int) -> tuple[list[Held], list[str]]:
    """The complete copies of `expect.rank` that `holder` holds in `directory`, newest first,
    and why the others were refused."""
    held, refused = [], []
    for slot in range(SLOTS):
        try:
            found = inspect(directory, expect.rank, slot, expect)
        except SlotRefused as exc:
            refused.append(str(exc))
            continue
        keeper = found.record.get("partner")
        if isinstance(keeper, dict) and keeper.get("holder") == holder:
            held.append(found)
    return sorted(held, key=lambda h: h.step, reverse=True), refused


def find_held(job_dir: Path, expect: Expect) -> dict[int, list[Held]]:
    """Every ward's complete copies this rank (`expect.rank`) holds, newest first."""
    directory = partner_dir(job_dir)
    out: dict[int, list[Held]] = {}
    try:
        if directory.is_symlink():
            return out
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return out
    for name in names:
        if not _WARD_DIR.fullmatch(name):  # junk, or another spelling of a rank's directory
            continue
        ward = int(name.removeprefix("rank-"))
        if ward == expect.rank or ward >= expect.world or (directory / name).is_symlink():
            continue
        held, _ = find_ward(directory, ward_expect(expect, ward), expect.rank)
        if held:
            out[ward] = held
    return out


def forget_held(job_dir: Path) -> None:
    """Every partner copy on this node: a fresh timeline must never resume the old one's."""
    shutil.rmtree(partner_dir(job_dir), ignore_errors=True)
