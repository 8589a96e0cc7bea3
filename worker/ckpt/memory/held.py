"""Which slots a rank holds, and which step the ranks agree to resume from: each rank inspects
its own two slots, then one collective picks the newest step that every rank holds complete
(and tells every rank the first reason a slot was refused). Also the job's directory on the
node: held for the process's life, removed when its last holder is gone.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from contracts import locks, scratch
from worker import collectives
from worker.ckpt.memory.checksum import record_problem, table_problem
from worker.ckpt.memory.partners import plan as partner_plan
from worker.ckpt.memory.slot_file import (
    FORMAT,
    HEADER_BYTES,
    SLOTS,
    Expect,
    SlotRefused,
    rank_dir,
    read_header,
    read_record,
    slot_paths,
)

# The longest reason a rank tells the others (a refused slot's, for the `resumed` event).
REASON_BYTES = 400

_held: dict[str, int] = {}  # job dir -> the shared lock this process holds on it


@dataclass(frozen=True)
class Held:
    """A complete slot of this rank."""

    slot: int
    step: int
    gen: int
    record: dict[str, Any]
    path: Path  # the .bin


@dataclass(frozen=True)
class MemoryChoice:
    """Every rank resumes from its own slot of `step` (`from_partner`: some rank's was fetched
    from the partner copy another node held, `partner_fetch`)."""

    step: int
    held: Held
    from_partner: bool = False


def job_dir(env: dict[str, str] | os._Environ, tag: str) -> Path:
    return Path(scratch.mem_dir(scratch.mem_root(env), tag))


def hold(directory: Path) -> None:
    """Hold the job's directory (shared) for this process's life: no sweep removes it meanwhile."""
    key = str(directory)
    if key not in _held:
        _held[key] = locks.hold_mem_dir(directory)


def release(directory: Path) -> None:
    fd = _held.pop(str(directory), None)
    if fd is not None:
        os.close(fd)


def inspect(directory: Path, rank: int, slot: int, expect: Expect) -> Held:
    """The slot if it is a complete copy of this run's state for this rank; else SlotRefused
    naming why (torn, another world, another node, …)."""
    bin_path, json_path = slot_paths(directory, rank, slot)
    try:
        before, after, nbytes = read_header(bin_path)
        record = json.loads(read_record(json_path))
        size = bin_path.stat().st_size
    except FileNotFoundError:
        raise SlotRefused(f"slot {slot}: missing") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested deep
        raise SlotRefused(f"slot {slot}: unreadable ({str(exc)[:200]})") from None
    if not isinstance(record, dict) or not isinstance(record.get("gen"), int):
        raise SlotRefused(f"slot {slot}: no record")
    if record.get("format") != FORMAT:
        raise SlotRefused(f"slot {slot}: format {record.get('format')!r}, this run {FORMAT!r}")
    problem = record_problem(record)
    if problem:
        raise SlotRefused(f"slot {slot}: {problem}")
    if not before == after == record["gen"]:
        raise SlotRefused(f"slot {slot}: torn (a copy was cut short)")
    if size != HEADER_BYTES + nbytes or record.get("nbytes") != nbytes:
        raise SlotRefused(f"slot {slot}: {size} bytes, its record says {nbytes}")
    problem = identity_problem(record, expect, nbytes)
    if problem:
        raise SlotRefused(f"slot {slot}: {problem}")
    return Held(slot, record["step"], record["gen"], record, bin_path)


def identity_problem(record: dict[str, Any], expect: Expect, nbytes: int) -> str | None:
    """Why a sealed record is not a copy of this run's state for `expect.rank` (another job,
    world, mesh, model or node; a None in `expect`: any), or its table does not fit its `nbytes`
    of data; None when it is. A slot's and a received partner copy's check alike."""
    for key, value in expect.record().items():  # None: any (a partner copy's node)
        if value is not None and record.get(key) != value:
            return f"{key} {record.get(key)!r}, this run {value!r}"
    if not isinstance(record.get("step"), int) or not isinstance(record.get("table"), dict):
        return "incomplete record"
    return table_problem(record["table"], nbytes)


def find(directory: Path, expect: Expect) -> tuple[list[Held], list[str]]:
    """This rank's complete slots, newest first, and why the others were refused."""
    held, refused = [], []
    for slot in range(SLOTS):
        try:
            held.append(inspect(directory, expect.rank, slot, expect))
        except SlotRefused as exc:
            refused.append(str(exc))
    return sorted(held, key=lambda h: h.step, reverse=True), refused


def newest_common(steps_per_rank: list[list[int]]) -> int | None:
    """Pure: the newest step that every rank holds complete; None when there is none."""
    if not steps_per_rank:
        return None
    common = set(steps_per_rank[0]).intersection(*map(set, steps_per_rank[1:]))
    return max(common) if common else None


@dataclass(frozen=True)
class Agreement:
    step: int | None  # the newest step every rank holds complete (itself or through a partner)
    without: list[int]  # ranks that hold no complete slot of their own
    durable: int | None  # the newest complete durable step (rank 0's scan)
    fetch: list[tuple[int, int]] = field(default_factory=list)  # (rank, holder): from a partner

    @property
    def use_memory(self) -> bool:
        """Memory only when it is newer than the durable tier (docs/checkpoints.md)."""
        return self.step is not None and (self.durable is None or self.step > self.durable)


def agree(
    held: list[Held],
    newest_durable: int | None,
    partner_held: dict[int, list[Held]] | None = None,
) -> Agreement:
    """Collective, one all-gather: every rank's complete steps, the steps of the copies it holds
    for other ranks (`partner_held`: ward -> its copies), and rank 0's newest durable step, so
    that every rank takes the same decision (`partners.plan`)."""
    mine = {
        "own": [h.step for h in held[:SLOTS]],
        "held": {str(w): [h.step for h in hs] for w, hs in (partner_held or {}).items()},
        "durable": newest_durable,
    }
    every = collectives.all_gather_json(mine)
    own = [[int(s) for s in e["own"]] for e in every]
    others = [{int(w): [int(s) for s in steps] for w, steps in e["held"].items()} for e in every]
    chosen = partner_plan(own, others)
    durable = every[0]["durable"]
    return Agreement(
        chosen.step,
        [r for r, steps in enumerate(own) if not steps],
        int(durable) if durable is not None else None,
        chosen.fetch,
    )


def first_refusal(reason: str | None) -> str | None:
    """Collective: `rank R: <reason>` of the lowest rank that gives one (and how many more
    did), the same text on every rank; None, on every rank, when none gives one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = collectives.group_device()
    first = torch.tensor([rank if reason else world], dtype=torch.int64, device=device)
    count = torch.tensor([1 if reason else 0], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    first_rank, how_many = int(first.item()), int(count.item())
    if how_many == 0:
        return None
    text = torch.zeros(REASON_BYTES, dtype=torch.uint8)
    if rank == first_rank:
        raw = reason.encode()[:REASON_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(device)
    dist.broadcast(text, src=first_rank)
    said = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    more = how_many - 1
    return f"rank {first_rank}: {said}" + (
        f" (and {more} more rank{'s' if more > 1 else ''})" if more else ""
    )


def forget(directory: Path, rank: int) -> None:
    """Remove this rank's slots (a fresh start must not later resume another timeline's)."""
    shutil.rmtree(rank_dir(directory, rank), ignore_errors=True)
