"""Partner copies without a process group: who holds whose copy, which step a resume takes,
what a holder keeps or refuses of what it receives, and the link between two ranks over real
ZeroMQ sockets on loopback."""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import replace

import pytest
import torch

from worker.ckpt import memory
from worker.ckpt.memory import partner_copy, partner_fetch, partner_link, partners
from worker.hooks import Hooks

EXPECT = memory.Expect(
    job="j1", rank=1, world=4, mesh="dp_shard=4", model_fingerprint="abc", host="n1"
)
NBYTES = 3 * 4096 + 100


# --- who holds whose copy ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nodes", "want"),
    [
        (["a", "a", "b", "b", "c", "c"], [2, 3, 4, 5, 0, 1]),  # the same place on the next node
        (["a", "b"], [1, 0]),
        (["a", "a", "b"], [2, 2, 0]),  # a smaller next node: its place modulo its size
        (["a", "a"], [None, None]),  # one node: no partner
        ([], []),
    ],
)
def test_a_rank_s_copy_is_held_on_the_next_node(nodes, want):
    assert partners.holders(nodes) == want


def test_no_rank_holds_its_own_copy_or_one_of_its_node():
    nodes = [f"n{r // 3}" for r in range(12)]
    for rank, holder in enumerate(partners.holders(nodes)):
        assert nodes[holder] != nodes[rank]


# --- which step a resume takes ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("own", "held", "step", "fetch"),
    [
        ([[7, 6], [7, 6]], [{}, {}], 7, []),  # every rank's own: no fetch
        ([[7, 6], []], [{1: [7, 6]}, {}], 7, [(1, 0)]),  # rank 1's node lost: from rank 0
        ([[7, 6], [6, 5]], [{1: [7]}, {0: [6]}], 7, [(1, 0)]),  # its own 7 torn: the partner's
        ([[7, 6], []], [{}, {}], None, []),  # no copy of rank 1 anywhere: durable
        ([[], []], [{1: [5]}, {0: [4]}], None, []),  # both nodes lost their own: no common step
        ([[7, 6], [6]], [{1: [7, 6]}, {}], 7, [(1, 0)]),  # the newest, fetched, over own 6
        ([[7], []], [{0: [7], 1: [7]}, {}], 7, [(1, 0)]),  # a rank's copy of itself: ignored
        ([[7], []], [{}, {9: [7]}], None, []),  # a ward outside the world: ignored
    ],
)
def test_the_newest_step_every_rank_holds_itself_or_through_a_partner(own, held, step, fetch):
    chosen = partners.plan(own, held)
    assert (chosen.step, chosen.fetch, chosen.from_partner) == (step, fetch, bool(fetch))


def test_two_neighbouring_nodes_lost_leave_no_common_step():
    """4 nodes x 1 rank, copies on the next node: nodes 1 and 2 lost take rank 1's own copies and
    the ones rank 2 held of it."""
    own = [[5, 4], [], [], [5, 4]]
    held = [{3: [5, 4]}, {}, {}, {2: [5, 4]}]  # rank 2's copies are on rank 3 (alive)
    assert partners.plan(own, held).step is None
    held[0] = {3: [5, 4]}
    assert partners.plan([[5, 4], [], [5, 4], [5, 4]], [{3: [5]}, {}, {1: [5, 4]}, {2: [5]}]) == (
        partners.PartnerPlan(5, [(1, 2)])
    )


# --- what a holder keeps ----------------------------------------------------------------------
def copy_of(step: int, expect=EXPECT, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """A sealed record of `expect.rank`'s state (two tensors and padding) and its bytes."""
    data = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.manual_seed(seed))
    table = {
        "a": {"dtype": "torch.uint8", "shape": [8192], "offset": 0, "nbytes": 8192,
              "digest": memory.digest(data[:8192])},
        "b": {"dtype": "torch.uint8", "shape": [4096], "offset": 8192, "nbytes": 4096,
              "digest": memory.digest(data[8192:12288])},
        "lr": {"value": 0.5},
    }  # fmt: skip
    record = {**expect.record(), "gen": 9, "step": step, "nbytes": NBYTES, "meta": {}}
    return memory.checked({**record, "table": table}), data


def holder_store(tmp_path, rank: int = 2) -> memory.PartnerStore:
    return memory.PartnerStore(tmp_path, replace(EXPECT, rank=rank, host="n2"), rank, "n2", Hooks())


def test_a_received_copy_is_held_sealed_and_found(tmp_path):
    store = holder_store(tmp_path)
    for step in (5, 6, 7):
        record, data = copy_of(step, seed=step)
        assert store.receive(record, memoryview(data.numpy())) == (1, step)
    store.close()
    held = memory.find_held(tmp_path, replace(EXPECT, rank=2, host="n2"))
    assert [h.step for h in held[1]] == [7, 6]  # two slots: the two newest
    assert held[1][0].record["partner"]["holder"] == 2
    assert not memory.find_held(tmp_path, replace(EXPECT, rank=3, host="n2"))  # not rank 3's


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda r: memory.checked({**r, "job": "other"}), "job 'other', this run 'j1'"),
        (lambda r: memory.checked({**r, "world": 8}), "world 8, this run 4"),
        (lambda r: memory.checked({**r, "nbytes": 9}), f"{NBYTES} bytes received"),
        (lambda r: {**r, "rank": 2}, "a copy of rank 2, not one this rank holds"),
        (lambda r: {**r, "rank": 9}, "a copy of rank 9, not one this rank holds"),
        (lambda r: {**r, "step": 8}, "fails its checksum"),  # changed after it was sealed
        (lambda r: "a string", "a copy of rank None"),
    ],
)
def test_a_copy_of_another_run_or_rank_is_refused(tmp_path, change, says):
    record, data = copy_of(5)
    with pytest.raises(memory.SlotRefused) as err:
        holder_store(tmp_path).receive(change(record), memoryview(data.numpy()))
    assert says in str(err.value)


def test_a_copy_whose_bytes_were_damaged_on_the_way_is_held_but_never_loaded(tmp_path):
    """The holder does not check the bytes it receives (that would cost a pass over them every
    step); the fetch checks every tensor's digest before anything is loaded, and refuses."""
    store = holder_store(tmp_path / "n2")
    record, data = copy_of(5)
    store.receive(record, memoryview(data.numpy()))
    record, data = copy_of(6, seed=6)
    data[100] ^= 1
    assert store.receive(record, memoryview(data.numpy())) == (1, 6)
    store.close()
    held = memory.find_held(tmp_path / "n2", replace(EXPECT, rank=2, host="n2"))
    assert [h.step for h in held[1]] == [6, 5]
    for copy, refused in zip(held[1], (True, False), strict=True):
        raw, sent = partner_fetch._read_copy(copy)
        fetched, why = partner_fetch._take(
            copy.step, 2, tmp_path / "n1", EXPECT, [], json.loads(raw), sent
        )
        assert (fetched is None) == refused
        if refused:
            assert why == "the copy of step 6 from rank 2: a: its bytes fail their checksum"
        else:
            assert fetched.step == 5 and why is None  # installed as rank 1's own slot


def test_a_hundred_copies_damaged_at_random_none_is_loaded(tmp_path):
    """One bit flipped in a held copy: in its header's fields, a tensor's bytes or its record
    (padding holds nothing and is never read). The check a fetch makes (the record as found,
    then every tensor's digest) refuses every one."""
    store = holder_store(tmp_path)
    record, data = copy_of(5)
    store.receive(record, memoryview(data.numpy()))
    store.close()
    (held,) = memory.find_held(tmp_path, replace(EXPECT, rank=2, host="n2"))[1]
    bin_path, json_path = held.path, held.path.with_suffix(".json")
    good = bin_path.read_bytes(), json_path.read_bytes()
    rng, loaded = random.Random(27), 0
    for _ in range(100):
        path, original = rng.choice([(bin_path, good[0]), (json_path, good[1])])
        damaged = bytearray(original)
        at = rng.randrange(len(damaged))
        if path == bin_path:  # the header's fields or a tensor's bytes (padding is never read)
            at = rng.choice([rng.randrange(32), 4096 + rng.randrange(12288)])
        damaged[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            found = memory.find_held(tmp_path, replace(EXPECT, rank=2, host="n2")).get(1, [])
            for h in found:
                data = torch.frombuffer(bytearray(h.path.read_bytes()[4096:]), dtype=torch.uint8)
                if partner_copy.bytes_problem(h.record["table"], data) is None:
                    loaded += 1
        finally:
            path.write_bytes(original)
    assert loaded == 0


# --- the link, over real sockets --------------------------------------------------------------
def wait_for(check, timeout_s: float = 10.0, what=lambda: None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out: {what()}"
        time.sleep(0.01)


def test_a_copy_sent_over_the_link_is_held_and_a_foreign_one_refused(tmp_path):
    holder = partner_link.PartnerLink(holder_store(tmp_path), "127.0.0.1", 1 << 20)
    sender = partner_link.PartnerLink(None, "127.0.0.1", 1 << 20)
    stranger = partner_link.PartnerLink(None, "127.0.0.1", 1 << 20)
    try:
        holder.start(b"k" * 64, None)
        sender.start(b"k" * 64, holder.endpoint)
        stranger.start(b"x" * 64, holder.endpoint)
        record, data = copy_of(5)
        sender.offer(record, data)
        wait_for(lambda: holder.stats().received == 1 and sender.stats().sent == 1)
        stranger.offer(*copy_of(6))
        wait_for(lambda: holder.stats().refused == 1)
        assert "not signed with this run's key" in holder.stats().last_refusal
        assert sender.stats().nbytes == NBYTES and sender.stats().skipped == 0
    finally:
        for link in (holder, sender, stranger):
            link.close()
    held = memory.find_held(tmp_path, replace(EXPECT, rank=2, host="n2"))
    assert [h.step for h in held[1]] == [5]


def test_a_partner_that_takes_nothing_costs_skipped_copies_not_waits(tmp_path):
    """Nothing listens at the holder's end: the sender keeps at most one copy on its way (`sent`
    counts a copy handed to the network, which may drop it) and skips the copies offered
    meanwhile; an offer never waits for the network."""
    sender = partner_link.PartnerLink(None, "127.0.0.1", 1 << 20)
    try:
        sender.start(b"k" * 64, "tcp://127.0.0.1:9")  # nothing listens there
        record, data = copy_of(5)
        for _ in range(20):
            sender.offer(record, data)
        done = sender.stats
        wait_for(lambda: done().sent + done().skipped == 20, what=done)
        assert done().skipped >= 10 and "step 5" in done().last_skip
    finally:
        sender.close()


def test_the_link_binds_loopback_when_every_rank_shares_one_host():
    assert partner_link.bind_host(["h", "h", "h"]) == "127.0.0.1"


# --- a fetch whose holder sends no copy -------------------------------------------------------
def _bump_generation(path):
    raw = bytearray(path.read_bytes())
    raw[8:24] = (999).to_bytes(8, "little") * 2  # a copy sealed since it was found
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda p: p.unlink(), "(FileNotFoundError: "),
        (lambda p: os.truncate(p, 4096 + 100), "(the copy ends early)"),
        (_bump_generation, "(the copy changed while it was read)"),
        (None, "(it holds none)"),
    ],
)
def test_a_holder_that_sends_no_copy_says_why(tmp_path, monkeypatch, spoil, says):
    """The holder's copy gone, cut short or written again since the ranks chose it: the rank
    refuses the fetch saying what its holder found (the ranks then choose again)."""
    store = holder_store(tmp_path)
    store.receive(*(lambda r, d: (r, memoryview(d.numpy())))(*copy_of(5)))
    store.close()
    holding = memory.find_held(tmp_path, replace(EXPECT, rank=2, host="n2"))
    if spoil is None:
        holding = {}
    else:
        spoil(holding[1][0].path)
    wire: list[torch.Tensor] = []
    monkeypatch.setattr(partner_fetch.collectives, "group_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(partner_fetch.collectives, "all_gather_json", lambda v: [v])
    monkeypatch.setattr(partner_fetch.dist, "send", lambda t, dst: wire.append(t.clone()))
    monkeypatch.setattr(partner_fetch.dist, "recv", lambda t, src: t.copy_(wire.pop(0)))
    holder = replace(EXPECT, rank=2, host="n2")
    partner_fetch.fetch(5, [(1, 2)], job_dir=tmp_path, expect=holder, own=[], holding=holding)
    fetched, problem, failed = partner_fetch.fetch(
        5, [(1, 2)], job_dir=tmp_path / "n1", expect=EXPECT, own=[], holding={}
    )
    assert fetched is None and failed == [1] and not wire
    assert problem.startswith(f"rank 2 sent no copy of step 5 {says}"), problem
    assert "\n" not in problem and len(problem) < 400
