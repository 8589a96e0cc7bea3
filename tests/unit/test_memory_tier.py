"""The memory tier's decisions and its slot format, without a process group: what counts as a
complete slot, which step the ranks agree on, whether the slots fit."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from worker.ckpt import memory

EXPECT = memory.Expect(
    job="j1", rank=0, world=2, mesh="dp_shard=2", model_fingerprint="abc", host="node0"
)


@pytest.mark.parametrize(
    "steps,want",
    [
        ([[7, 6], [7, 6]], 7),
        ([[7, 6], [6, 5]], 6),  # rank 1's copy of 7 was torn: 6 is the newest both hold
        ([[7, 6], []], None),  # a rank without a slot: durable for all
        ([[9, 8], [7, 6]], None),
        ([[5]], 5),
        ([], None),
    ],
)
def test_newest_common(steps, want):
    assert memory.newest_common(steps) == want


@pytest.mark.parametrize(
    "step,durable,use",
    [(7, 5, True), (5, 5, False), (4, 5, False), (3, None, True), (None, 5, False)],
)
def test_memory_only_when_newer_than_durable(step, durable, use):
    assert memory.Agreement(step, [], durable).use_memory is use


def test_room_needs_a_margin_and_counts_slots_already_there():
    gib = 2**30
    where = Path("/dev/shm")
    assert memory.room_problem(2 * gib, 16 * gib, 8 * gib, 0, where) is None
    full = memory.room_problem(8 * gib, 16 * gib, 8 * gib, 0, where)
    assert full and "need 8.00 GiB" in full and "ES_MEM_ROOT" in full
    assert memory.room_problem(8 * gib, 16 * gib, 8 * gib, 4 * gib, where) is None


def write_slot(directory: Path, slot: int, step: int, expect=EXPECT) -> memory.MappedSlot:
    """A real slot file, mapped and sealed as the copy thread does."""
    bin_path, json_path = memory.slot_paths(directory, expect.rank, slot)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    s = memory.MappedSlot(bin_path, json_path)
    block = s.map(4096)
    block[:8].copy_(torch.arange(8, dtype=torch.uint8))
    gen = step + 100
    s.begin(gen)
    table = {"model.w": {"dtype": "torch.uint8", "shape": [8], "offset": 0, "nbytes": 8,
                         "digest": memory.digest(block[:8])}}  # fmt: skip
    record = {**expect.record(), "gen": gen, "step": step, "nbytes": 4096, "meta": {}}
    s.seal(gen, memory.checked({**record, "table": table}))
    return s


def test_a_sealed_slot_is_complete_and_readable(tmp_path):
    write_slot(tmp_path, 0, 7)
    write_slot(tmp_path, 1, 8)
    held, refused = memory.find(tmp_path, EXPECT)
    assert [h.step for h in held] == [8, 7] and not refused
    assert (tmp_path / "rank-0/slot-0.bin").stat().st_mode & 0o777 == 0o600
    live = {"model.w": torch.zeros(8, dtype=torch.uint8)}
    memory.read_into(held[0].path, live, held[0].record["table"])
    assert live["model.w"].tolist() == list(range(8))


def test_a_slot_whose_copy_began_again_is_torn(tmp_path):
    s = write_slot(tmp_path, 0, 7)
    s.begin(999)  # a new copy started and was cut short
    with pytest.raises(memory.SlotRefused, match="torn"):
        memory.inspect(tmp_path, 0, 0, EXPECT)


def test_a_slot_without_its_record_or_header_is_refused(tmp_path):
    write_slot(tmp_path, 0, 7)
    (tmp_path / "rank-0/slot-0.json").unlink()
    with pytest.raises(memory.SlotRefused, match="missing"):
        memory.inspect(tmp_path, 0, 0, EXPECT)
    with pytest.raises(memory.SlotRefused, match="missing"):
        memory.inspect(tmp_path, 0, 1, EXPECT)


@pytest.mark.parametrize(
    "field,value",
    [("world", 4), ("mesh", "dp_shard=1,tp=2"), ("host", "node9"), ("model_fingerprint", "x")],
)
def test_a_slot_of_another_run_shape_or_node_is_refused(tmp_path, field, value):
    write_slot(tmp_path, 0, 7)
    with pytest.raises(memory.SlotRefused, match=field):
        memory.inspect(tmp_path, 0, 0, memory.Expect(**{**EXPECT.__dict__, field: value}))


def test_a_crafted_table_pointing_outside_the_slot_is_refused(tmp_path):
    write_slot(tmp_path, 0, 7)
    path = tmp_path / "rank-0/slot-0.json"
    record = json.loads(path.read_text())
    record["table"]["model.w"]["offset"] = 1 << 40
    path.write_text(json.dumps(memory.checked(record)))
    with pytest.raises(memory.SlotRefused, match="outside the slot"):
        memory.inspect(tmp_path, 0, 0, EXPECT)


def test_a_file_of_another_size_than_recorded_is_refused(tmp_path):
    write_slot(tmp_path, 0, 7)
    with (tmp_path / "rank-0/slot-0.bin").open("ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(memory.SlotRefused, match="bytes"):
        memory.inspect(tmp_path, 0, 0, EXPECT)


def test_a_foreign_file_is_not_a_slot(tmp_path):
    write_slot(tmp_path, 0, 7)
    path = tmp_path / "rank-0/slot-0.bin"
    data = bytearray(path.read_bytes())
    data[:8] = b"NOTASLOT"
    path.write_bytes(bytes(data))
    with pytest.raises(memory.SlotRefused, match="not a memory slot"):
        memory.inspect(tmp_path, 0, 0, EXPECT)
    assert struct.calcsize("<8sQQQ") <= memory.HEADER_BYTES
