"""The memory tier: every `--mem-ckpt-interval` steps each rank copies its own shard of the whole
training state into node-local shared memory, which outlives the rank; a relaunch on the same
nodes resumes from it when every rank holds the same newer step (docs/checkpoints.md).

Layout, one directory per job on each node (0700; files 0600):
```
<ES_MEM_ROOT or /dev/shm>/es-mem-<job>/  .es-lock  rank-<R>/slot-<0|1>.bin  slot-<0|1>.json
```
A slot's `.bin` is a header page (magic, generation written before the copy, generation written
after it) and then the tensors' bytes, mapped once and reused by every copy (the async stage's
`ReusedStager`, its block being this mapping). Its `.json` (replaced atomically, after the bytes)
names the generation, the step, the run identity, where each tensor lies, and what is not a tensor
(scheduler, RNG, data position). A slot is complete only when both generations in the header
equal the record's: a rank killed mid-copy leaves a torn slot that never passes, and its other
slot, the previous copy, stays whole. The two slots alternate.

Checked: each tensor's entry holds its bytes' `digest`, one per 4 MiB (`page_sums_crc`: the
CRC-32 of its 4 KiB page sums, each page's 64-bit words added mod 2**64), its page sums taken
as the copy goes (each piece right after its copy, while in the cache), its CRC-32s on the copy
thread after the copy (the loop does not wait for them), and the record its own CRC-32
(`check`), all written before the closing generation. A load checks each piece of a tensor as
it reads it (its sums taken while it is in the cache); a slot that fails is refused, and the
ranks choose again (`resume.choose_tiers`). Against damage, not an adversary who can write the
files: one changed 64-bit word is always caught; a page's words swapped among themselves, or
two changes that cancel in a page's sum, are not.

Its parts, each imported only by those after it: `checksum` (the digests and the record's CRC),
`slot_file` (a slot's two files: writing, reading and checking them), `held` (which slots a rank
holds and which step the ranks agree on), `state_view` (the state dict, taken once and handed
again while it holds the live tensors), `slot_copy` (the copy into a slot with its page sums),
`tier` (the copies while training, and the load). The names below are the tier's interface to
the rest of the checkpoint code.
"""

from worker.ckpt.memory.checksum import CHECK_CHUNK, PAGE_BYTES, checked, digest, page_sums_crc
from worker.ckpt.memory.held import (
    Agreement,
    MemoryChoice,
    agree,
    find,
    first_refusal,
    forget,
    hold,
    inspect,
    job_dir,
    newest_common,
)
from worker.ckpt.memory.partner_copy import PartnerStore, find_held, forget_held
from worker.ckpt.memory.partner_fetch import fetch
from worker.ckpt.memory.slot_file import (
    HEADER_BYTES,
    READ_PIECE,
    SLOTS,
    Expect,
    MappedSlot,
    SlotRefused,
    read_header,
    read_into,
    slot_paths,
)
from worker.ckpt.memory.tier import MemoryTier, on_everywhere, room_problem

__all__ = [
    "CHECK_CHUNK",
    "HEADER_BYTES",
    "PAGE_BYTES",
    "READ_PIECE",
    "SLOTS",
    "Agreement",
    "Expect",
    "MappedSlot",
    "MemoryChoice",
    "MemoryTier",
    "PartnerStore",
    "SlotRefused",
    "agree",
    "checked",
    "digest",
    "find",
    "fetch",
    "find_held",
    "first_refusal",
    "forget_held",
    "forget",
    "hold",
    "inspect",
    "job_dir",
    "newest_common",
    "on_everywhere",
    "page_sums_crc",
    "read_header",
    "read_into",
    "room_problem",
    "slot_paths",
]
