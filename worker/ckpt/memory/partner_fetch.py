"""A resume from partner copies: each rank whose own copy of the agreed step is gone (its node
lost, a spare in its place) takes it from the rank that holds it, over the process group.

The holder reads its copy and sends the record and the bytes; the rank checks them (this run's
record, every tensor's digest: the holder took the bytes unchecked, so this is where damage on
the way or at rest is caught) and writes them into one of its own slots, sealed as its own on
this node. The load is then a memory load like any other, which
checks the bytes once more as it reads them. A copy that fails is refused and its holder
forgets it, so that the ranks choose again without it.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from worker import collectives
from worker.ckpt.memory.checksum import checked
from worker.ckpt.memory.held import Held, inspect
from worker.ckpt.memory.partner_copy import (
    bytes_problem,
    header_problem,
    partner_dir,
    ward_expect,
)
from worker.ckpt.memory.slot_file import (
    HEADER_BYTES,
    SLOTS,
    Expect,
    MappedSlot,
    SlotRefused,
    open_slot_file,
    read_header,
    slot_paths,
)

NONE_SENT = -1  # the holder has no copy to send after all (gone since it said it had)
REASON_BYTES = 300  # the most of the holder's why it sent none that reaches the rank


def _read_copy(held: Held) -> tuple[bytes, torch.Tensor]:
    """A held copy's record (as sealed: checked again where it is sent) and its bytes, read
    whole; SlotRefused if it changed meanwhile."""
    nbytes = held.record["nbytes"]
    data = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(data.numpy())
    fd = open_slot_file(held.path)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], HEADER_BYTES + done)
            if n <= 0:
                raise SlotRefused("the copy ends early")
            done += n
    finally:
        os.close(fd)
    before, after, _ = read_header(held.path)
    if not before == after == held.gen:
        raise SlotRefused("the copy changed while it was read")
    return json.dumps(held.record, separators=(",", ":")).encode(), data


def _send(dst: int, held: Held | None) -> None:
    """The copy to the rank; when there is none to send, why not in its place (the rank always
    hears from its holder)."""
    device = collectives.group_device()
    record, data, why = b"", None, "it holds none"
    try:
        if held is not None:
            record, data = _read_copy(held)
    except SlotRefused as exc:  # changed or cut short since it was found
        why = str(exc)
    except Exception as exc:  # gone, unreadable: none sent (the rank says why, the ranks
        why = f"{type(exc).__name__}: {exc}"  # choose again)
    if data is None:
        said = why.encode()[:REASON_BYTES]
        dist.send(torch.tensor([NONE_SENT, len(said)], dtype=torch.int64, device=device), dst=dst)
        if said:
            dist.send(torch.frombuffer(bytearray(said), dtype=torch.uint8).to(device), dst=dst)
        return
    dist.send(torch.tensor([len(record), data.numel()], dtype=torch.int64, device=device), dst=dst)
    dist.send(torch.frombuffer(bytearray(record), dtype=torch.uint8).to(device), dst=dst)
    dist.send(data.to(device), dst=dst)


def _receive(src: int) -> tuple[dict | str, torch.Tensor | None]:
    """The holder's copy: (its record, its bytes); (why none was sent, None) when none was."""
    device = collectives.group_device()
    sizes = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(sizes, src=src)
    record_len, nbytes = (int(x) for x in sizes.cpu().tolist())
    if record_len == NONE_SENT:
        why = torch.zeros(min(max(nbytes, 0), REASON_BYTES), dtype=torch.uint8, device=device)
        if why.numel():
            dist.recv(why, src=src)
        return bytes(why.cpu().tolist()).decode(errors="replace"), None
    raw = torch.empty(record_len, dtype=torch.uint8, device=device)
    dist.recv(raw, src=src)
    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.recv(data, src=src)
    try:
        record = json.loads(bytes(raw.cpu().numpy()))
    except (ValueError, RecursionError):
        record = {}  # no record: refused by the check
    return record, data.cpu()


def _install(
    job_dir: os.PathLike, expect: Expect, own: list[Held], record: dict, data: torch.Tensor
) -> Held:
    """A fetched copy into this rank's own slot that is not its newest complete one, sealed as
    this rank's on this node."""
    slot = (own[0].slot + 1) % SLOTS if own else 0
    gen = 1 + max((h.gen for h in own), default=0)
    target = MappedSlot(*slot_paths(job_dir, expect.rank, slot))
    target.bin_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    target.map(data.numel())
    target.begin(gen)
    target.block.copy_(data)
    mine = {k: v for k, v in record.items() if k != "partner"}
    target.seal(gen, checked({**mine, "gen": gen, "host": expect.host}))
    target.header = target.block = None
    return inspect(job_dir, expect.rank, slot, expect)


def _take(
    step: int, holder: int, job_dir, expect: Expect, own: list[Held], record, data: torch.Tensor
) -> tuple[Held | None, str | None]:
    """A copy received from `holder`: checked (this run's record, the step agreed, every
    tensor's digest), then installed; (the copy, None) or (None, why not)."""
    why = header_problem(record, ward_expect(expect, expect.rank), data.numel())
    if why is None and record["step"] != step:
        why = f"step {record['step']}, not step {step}"
    why = why or bytes_problem(record["table"], data)
    if why:
        return None, f"the copy of step {step} from rank {holder}: {why}"
    try:
        return _install(job_dir, expect, own, record, data), None
    except (OSError, SlotRefused) as exc:
        return None, f"the copy of step {step} could not be written here ({exc})"


def fetch(
    step: int,
    pairs: list[tuple[int, int]],
    *,
    job_dir,
    expect: Expect,
    own: list[Held],
    holding: dict[int, list[Held]],
) -> tuple[Held | None, str | None, list[int]]:
    """Collective: every (rank, holder) pair, in order (each pair's two ranks meet in the same
    order on both: no cycle can wait). Returns this rank's copy of `step` when it fetched one,
    why its fetch failed (None: it did not), and the ranks whose copies failed anywhere (every
    rank alike; their holders have forgotten them)."""
    fetched, problem = None, None
    for rank, holder in pairs:
        if expect.rank == holder:
            copy = next((h for h in holding.get(rank, []) if h.step == step), None)
            _send(rank, copy)
        elif expect.rank == rank:
            record, data = _receive(holder)
            if data is None:
                problem = f"rank {holder} sent no copy of step {step} ({record})"
                continue
            try:  # whatever fails here, this rank still joins the ranks' answer below
                fetched, problem = _take(step, holder, job_dir, expect, own, record, data)
            except Exception as exc:
                problem = f"the copy of step {step} from rank {holder}: {type(exc).__name__}: {exc}"
    failed = [
        r for r in collectives.all_gather_json(expect.rank if problem else None) if r is not None
    ]
    for rank in failed:
        for copy in holding.get(rank, []):
            if copy.step == step:
                for path in slot_paths(partner_dir(job_dir), rank, copy.slot):
                    path.unlink(missing_ok=True)
    return fetched, problem, failed
