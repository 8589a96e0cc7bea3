"""The memory slots' checksums (issue 25 item 1), without a process group: the copy thread's
digests, and a load that refuses any byte of a tensor that changed since (its first, its last, a
chunk's edges), a slot torn, truncated, swapped between ranks, a record or a checksum edited; a
good slot loads whole."""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.tier_support import EXPECT, Scheduler, cpu_tier, trained_linear
from worker.ckpt import memory

# Two tensors: "a" half a chunk, "b" a chunk and a bit more, its last page partial; then the
# stager's padding to the next page.
HALF = memory.CHECK_CHUNK // 2
B_BYTES = memory.CHECK_CHUNK + 2 * memory.PAGE_BYTES + 1000
NBYTES = HALF + B_BYTES + 4096 - B_BYTES % 4096


def reference_digest(data: bytes) -> int:
    """page_sums_crc as its docstring says it, in numpy (uint64 sums wrap by definition)."""
    padded = data + bytes(-len(data) % memory.PAGE_BYTES)
    words = np.frombuffer(padded, dtype="<u8").reshape(-1, memory.PAGE_BYTES // 8)
    sums = words.sum(axis=1, dtype=np.uint64)
    import zlib

    return zlib.crc32(sums.astype("<u8").tobytes())


@pytest.mark.parametrize("n", [3, 8, 4096, 4096 * 3 + 8, 4096 * 3 + 5, 1 << 20])
def test_the_digest_is_the_crc32_of_the_page_sums(n):
    data = bytes(random.Random(n).getrandbits(8) for _ in range(min(n, 64))) * -(-n // 64)
    data = data[:n]
    chunk = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert memory.page_sums_crc(chunk) == reference_digest(data)
    assert memory.digest(chunk) == f"{reference_digest(data):08x}"
    assert memory.page_sums_crc(chunk[:0]) == 0
    if n > 8:  # not on an 8-byte boundary: the same sums
        odd = torch.frombuffer(bytearray(b"x" + data), dtype=torch.uint8)[1:]
        assert memory.page_sums_crc(odd) == reference_digest(data)


def test_a_digest_is_one_crc_per_chunk_carried_over_its_pieces():
    data = torch.randint(0, 256, (2 * memory.CHECK_CHUNK + 4096,), dtype=torch.uint8)
    whole = memory.digest(data)
    assert len(whole) == 3 * 8
    crc = 0
    for o in range(0, memory.CHECK_CHUNK, memory.READ_PIECE):  # as the load reads it
        crc = memory.page_sums_crc(data[o : o + memory.READ_PIECE], crc)
    assert f"{crc:08x}" == whole[:8]


def test_one_changed_word_always_changes_its_chunk_s_digest():
    base = torch.randint(0, 256, (64 * memory.PAGE_BYTES,), dtype=torch.uint8)
    want = memory.page_sums_crc(base)
    for offset in (0, 7, 4095, 4096, 100_000, base.numel() - 1):
        for bit in (0, 7):
            damaged = base.clone()
            damaged[offset] ^= 1 << bit
            assert memory.page_sums_crc(damaged) != want, (offset, bit)
    swapped = base.clone()  # two pages trade places: their sums move with them
    swapped[:4096], swapped[4096:8192] = base[4096:8192].clone(), base[:4096].clone()
    assert memory.page_sums_crc(swapped) != want


def write_slot(directory: Path, slot: int, step: int, data: torch.Tensor, expect=EXPECT) -> Path:
    """A sealed slot holding `data` as two tensors and padding, as the copy thread seals it."""
    bin_path, json_path = memory.slot_paths(directory, expect.rank, slot)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    s = memory.MappedSlot(bin_path, json_path)
    block = s.map(data.numel())
    block.copy_(data)
    gen = step + 100
    s.begin(gen)
    table = {
        "a": {"dtype": "torch.uint8", "shape": [HALF], "offset": 0, "nbytes": HALF,
              "digest": memory.digest(block[:HALF])},
        "b": {"dtype": "torch.int8", "shape": [B_BYTES], "offset": HALF, "nbytes": B_BYTES,
              "digest": memory.digest(block[HALF : HALF + B_BYTES])},
        "step": {"dtype": "torch.float32", "shape": [], "value": 3.0},
        "lr": {"value": 0.5},
    }  # fmt: skip
    record = {**expect.record(), "gen": gen, "step": step, "nbytes": data.numel(), "meta": {}}
    s.seal(gen, memory.checked({**record, "table": table}))
    s.header = s.block = None
    return bin_path


def live_state() -> dict:
    return {
        "a": torch.zeros(HALF, dtype=torch.uint8),
        "b": torch.zeros(B_BYTES, dtype=torch.int8),
        "step": torch.tensor(0.0),
        "lr": 0.0,
    }


def load(directory: Path, slot: int = 0, expect=EXPECT) -> dict:
    held = memory.inspect(directory, expect.rank, slot, expect)
    live = live_state()
    memory.read_into(held.path, live, held.record["table"])
    return live


@pytest.fixture
def data() -> torch.Tensor:
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator())


def test_a_good_slot_loads_whole(tmp_path, data):
    write_slot(tmp_path, 0, 7, data)
    live = load(tmp_path)
    assert torch.equal(live["a"], data[:HALF])
    assert torch.equal(live["b"].view(torch.uint8), data[HALF : HALF + B_BYTES])
    assert live["step"].item() == 3.0 and live["lr"] == 0.5


B_CHUNKS = [
    f"its bytes 0-{memory.CHECK_CHUNK - 1}",
    f"its bytes {memory.CHECK_CHUNK}-{B_BYTES - 1}",
]


@pytest.mark.parametrize(
    "offset,refused",
    [
        (0, f"a: its {HALF} bytes"),
        (1, f"a: its {HALF} bytes"),
        (HALF - 1, f"a: its {HALF} bytes"),
        (HALF, f"b: {B_CHUNKS[0]}"),
        (HALF + memory.READ_PIECE, f"b: {B_CHUNKS[0]}"),
        (HALF + memory.CHECK_CHUNK - 1, f"b: {B_CHUNKS[0]}"),
        (HALF + memory.CHECK_CHUNK, f"b: {B_CHUNKS[1]}"),
        (HALF + B_BYTES - 1, f"b: {B_CHUNKS[1]}"),
    ],
    ids=["first", "second", "a-last", "b-first", "b-second-piece", "b-chunk-end",
         "b-chunk-start", "last"],
)  # fmt: skip
def test_a_flipped_byte_anywhere_in_a_tensor_is_refused(tmp_path, data, offset, refused):
    path = write_slot(tmp_path, 0, 7, data)
    for bit in (0, 7):
        with path.open("r+b") as f:
            f.seek(memory.HEADER_BYTES + offset)
            byte = f.read(1)[0]
            f.seek(memory.HEADER_BYTES + offset)
            f.write(bytes([byte ^ (1 << bit)]))
        memory.inspect(tmp_path, 0, 0, EXPECT)  # the header and record are as written
        with pytest.raises(memory.SlotRefused, match=re.escape(f"{refused} fail their checksum")):
            load(tmp_path)
        with path.open("r+b") as f:  # as it was: it loads
            f.seek(memory.HEADER_BYTES + offset)
            f.write(bytes([byte]))
        assert torch.equal(load(tmp_path)["a"], data[:HALF])


def test_padding_is_never_read_so_never_checked(tmp_path, data):
    """The stager's padding after a tensor is no state: damage there changes no loaded byte."""
    path = write_slot(tmp_path, 0, 7, data)
    with path.open("r+b") as f:
        f.seek(memory.HEADER_BYTES + HALF + B_BYTES)
        f.write(b"\xff" * (NBYTES - HALF - B_BYTES))
    live = load(tmp_path)
    assert torch.equal(live["b"].view(torch.uint8), data[HALF : HALF + B_BYTES])


def test_the_issue_s_flip_is_refused_before_any_later_chunk_is_read(tmp_path, data):
    """256 bytes just past the header XORed (the issue's case)."""
    path = write_slot(tmp_path, 0, 7, data)
    raw = bytearray(path.read_bytes())
    for i in range(memory.HEADER_BYTES, memory.HEADER_BYTES + 256):
        raw[i] ^= 0xA5
    path.write_bytes(bytes(raw))
    with pytest.raises(memory.SlotRefused, match=f"a: its {HALF} bytes fail their checksum"):
        load(tmp_path)


def test_a_torn_slot_is_still_refused(tmp_path, data):
    path = write_slot(tmp_path, 0, 7, data)
    with path.open("r+b") as f:  # a copy began again and was cut short
        f.seek(8)
        f.write((999).to_bytes(8, "little"))
    with pytest.raises(memory.SlotRefused, match="torn"):
        memory.inspect(tmp_path, 0, 0, EXPECT)


def test_a_truncated_slot_is_refused(tmp_path, data):
    path = write_slot(tmp_path, 0, 7, data)
    with path.open("r+b") as f:
        f.truncate(memory.HEADER_BYTES + NBYTES - 4096)
    with pytest.raises(memory.SlotRefused, match="bytes, its record says"):
        memory.inspect(tmp_path, 0, 0, EXPECT)
    record = json.loads(path.with_suffix(".json").read_text())
    with pytest.raises(memory.SlotRefused, match="b: the slot ends early"):  # cut after the look
        memory.read_into(path, live_state(), record["table"])


def test_slots_swapped_between_ranks_are_refused(tmp_path, data):
    """Same generations and sizes on both ranks: only the bytes tell one rank's from another's."""
    mine = write_slot(tmp_path, 0, 7, data)
    other = memory.Expect(**{**EXPECT.__dict__, "rank": 1})
    theirs = write_slot(tmp_path, 0, 7, torch.flip(data, [0]), expect=other)
    a, b = mine.read_bytes(), theirs.read_bytes()
    mine.write_bytes(b)
    theirs.write_bytes(a)
    with pytest.raises(memory.SlotRefused, match="fail their checksum"):
        load(tmp_path)
    with pytest.raises(memory.SlotRefused, match="fail their checksum"):
        load(tmp_path, expect=other)


def edit_record(directory: Path, change) -> None:
    path = memory.slot_paths(directory, 0, 0)[1]
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda r: r["meta"].update(x=1), "record fails its checksum"),
        (lambda r: r["table"]["lr"].update(value=0.25), "record fails its checksum"),
        (lambda r: r.update(step=8), "record fails its checksum"),
        (lambda r: r["table"]["a"].update(digest="0" * 8), "record fails"),
        (lambda r: r["check"].update(record=r["check"]["record"] ^ 1), "record fails"),
        (lambda r: r["check"].update(algo="md5"), "checksum 'md5'"),
        (lambda r: r.pop("check"), "no checksum"),
        (lambda r: r.update(format="es-mem-1"), "format 'es-mem-1'"),
    ],
    ids=["meta", "value", "step", "digests", "record-crc", "algo", "no-check", "old-format"],
)
def test_an_edited_record_or_checksum_is_refused(tmp_path, data, change, reason):
    write_slot(tmp_path, 0, 7, data)
    edit_record(tmp_path, change)
    with pytest.raises(memory.SlotRefused, match=reason):
        memory.inspect(tmp_path, 0, 0, EXPECT)


def test_a_record_with_a_flipped_byte_is_refused(tmp_path, data):
    write_slot(tmp_path, 0, 7, data)
    path = memory.slot_paths(tmp_path, 0, 0)[1]
    raw = path.read_bytes()
    for i in range(len(raw)):  # every byte in turn: unreadable, or fails its checksum
        damaged = bytearray(raw)
        damaged[i] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(memory.SlotRefused):
            memory.inspect(tmp_path, 0, 0, EXPECT)


def test_a_crafted_checksum_that_passes_its_crc_is_still_checked_for_shape(tmp_path, data):
    write_slot(tmp_path, 0, 7, data)
    path = memory.slot_paths(tmp_path, 0, 0)[1]
    record = json.loads(path.read_text())
    table = record["table"]
    for digest, reason in (
        ("ab", "does not cover"),
        ("zz" * 4, "not hexadecimal"),
        (None, "cover"),
    ):
        crafted = {**record, "table": {**table, "a": {**table["a"], "digest": digest}}}
        path.write_text(json.dumps(memory.checked(crafted)))
        with pytest.raises(memory.SlotRefused, match=f"'a': its checksum .*{reason}"):
            memory.inspect(tmp_path, 0, 0, EXPECT)
    wrong = {**table["b"], "nbytes": table["b"]["nbytes"] - 4}
    path.write_text(json.dumps(memory.checked({**record, "table": {**table, "b": wrong}})))
    with pytest.raises(memory.SlotRefused, match="bytes recorded"):
        load(tmp_path)


# ---- the copy thread ----------------------------------------------------------------------------
def test_the_copy_thread_checksums_and_seals_after_the_loop_is_released(tmp_path):
    model, optimizer = trained_linear()
    t = cpu_tier(tmp_path, model, optimizer)
    t.save(5, 10, {"kind": "x"})
    copied = t.wait_copied()
    assert copied is not None and copied.step == 5
    deadline = time.monotonic() + 30
    while t.sealed != 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.sealed == 5 and t.check_seconds is not None
    t.save(6, 12, {"kind": "x"})
    t.wait_copied()
    t.close(remove=False)
    held, refused = memory.find(tmp_path, EXPECT)
    assert [h.step for h in held] == [6, 5] and not refused, refused
    want = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = torch.nn.Linear(300, 700)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    loader = cpu_tier(tmp_path, fresh, fresh_opt)
    assert loader.load(held[0], Scheduler())["step"] == 6
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    loader.resumed_from(held[0])
    assert loader.target == (held[0].slot + 1) % memory.SLOTS

    with held[1].path.open("r+b") as f:  # the other slot damaged: refused, naming it
        f.seek(memory.HEADER_BYTES + 100)
        f.write(b"\xff" * 3)
    with pytest.raises(memory.SlotRefused, match=r"slot \d \(step 5\): model.weight: its 840000"):
        loader.load(held[1], Scheduler())
    loader.close(remove=False)


def test_a_slot_file_that_is_a_link_or_a_fifo_is_refused_without_blocking(tmp_path, data):
    path = write_slot(tmp_path, 0, 7, data)
    other = write_slot(tmp_path / "elsewhere", 0, 7, data)
    path.unlink()
    path.symlink_to(other)  # even to a good slot: not this rank's own file
    with pytest.raises(memory.SlotRefused, match="unreadable"):
        memory.inspect(tmp_path, 0, 0, EXPECT)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(memory.SlotRefused, match="not a regular file"):
        memory.inspect(tmp_path, 0, 0, EXPECT)
    json_path = path.with_suffix(".json")
    json_path.unlink()
    os.mkfifo(json_path)
    path.unlink()
    path.write_bytes(other.read_bytes())
    with pytest.raises(memory.SlotRefused, match="not a regular file"):
        memory.inspect(tmp_path, 0, 0, EXPECT)


def test_the_copy_thread_never_writes_through_a_planted_link(tmp_path):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    precious = tmp_path / "precious"
    precious.write_bytes(b"keep me")
    bin_path, json_path = memory.slot_paths(tmp_path / "mem", 0, 0)
    bin_path.parent.mkdir(parents=True)
    bin_path.symlink_to(precious)
    t = cpu_tier(tmp_path / "mem", model, optimizer)
    t.save(1, 2, {})
    assert t.wait_copied() is None and "copy failed" in t.off_reason, t.off_reason
    t.close(remove=False)
    assert precious.read_bytes() == b"keep me"
