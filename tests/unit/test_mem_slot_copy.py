"""The memory tier's copy with its page sums (`slot_copy`) and the state dict it copies, taken
once (`state_view`): the digests made from the sums are those of the bytes in the slot, and
the state dict handed again is the one DCP would give, until something replaces its tensors."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict

from tests.unit.tier_support import Scheduler, cpu_tier, trained_linear
from worker.ckpt import memory
from worker.ckpt.memory import slot_copy
from worker.ckpt.memory.slot_copy import SlotStager
from worker.ckpt.memory.state_view import StateView
from worker.ckpt.storage import aligned_zeros


def state(seed: int = 0) -> dict:
    """Tensors of every kind the copy meets: larger than a piece and not a whole number of
    pages, smaller than a page, 0-dim, strided, empty; and values that are not tensors."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(slot_copy.SUM_PIECE // 4 * 2 + 1234, generator=g)  # 2 pieces and a bit
    return {
        "model": {
            "big": big,
            "small": torch.randint(0, 1000, (77,), generator=g, dtype=torch.int64),
            "strided": torch.randn(1100, 1000, generator=g).t(),  # more than a piece, strided
            "empty": torch.empty(0),
        },
        "optim": {
            "state": {"big": {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, generator=g)}},
            "param_groups": [{"lr": 0.1 * (seed + 1), "betas": (0.9, 0.95), "params": ["big"]}],
        },
    }


def stager() -> SlotStager:
    return SlotStager(allocate=lambda n: aligned_zeros(n))


def check_table(staged: dict, table: dict, block: torch.Tensor) -> None:
    """Every tensor's digest is `memory.digest` of its bytes in the block, every value as in
    `staged`."""
    flat, _ = flatten_state_dict(staged)
    assert set(flat) == set(table)
    for key, value in flat.items():
        entry = table[key]
        if not isinstance(value, torch.Tensor):
            assert entry == {"value": list(value) if isinstance(value, tuple) else value}, key
        elif value.dim() == 0:
            assert entry["value"] == value.item(), key
        elif value.numel():
            data = block[entry["offset"] :][: entry["nbytes"]]
            assert entry["digest"] == memory.digest(data), key
            assert torch.equal(data.view(value.dtype).view(value.shape), value), key


def test_the_digests_from_the_copy_s_sums_are_those_of_the_slot_s_bytes():
    s, live = stager(), state(0)
    staged = s.stage(live)
    check_table(live, s.table(staged), s._block)
    assert len(s._plan.pieces) >= 4 and s.sum_seconds > 0
    for key, want in flatten_state_dict(live)[0].items():  # the snapshot: its own bytes
        if isinstance(want, torch.Tensor):
            assert torch.equal(flatten_state_dict(staged)[0][key], want), key


def test_a_later_copy_of_the_same_containers_copies_the_new_values():
    s, live = stager(), state(0)
    s.stage(live)
    plan, block = s._plan, s._block
    for t in (
        live["model"]["big"],
        live["model"]["strided"],
        live["optim"]["state"]["big"]["step"],
    ):
        t.add_(1)
    live["optim"]["param_groups"] = [{"lr": 0.5, "betas": (0.9, 0.95), "params": ["big"]}]
    staged = s.stage(live)
    assert s._plan is plan and s._block is block  # the same plan: no walk, no new slot
    assert staged["optim"]["param_groups"][0]["lr"] == 0.5
    assert staged["optim"]["state"]["big"]["step"].item() == 4.0
    check_table(live, s.table(staged), s._block)


def test_new_containers_get_a_new_plan_and_a_new_layout_a_new_slot():
    s = stager()
    s.stage(state(0))
    plan, block = s._plan, s._block
    live = state(1)  # new containers, the same layout: the slot is kept
    staged = s.stage(live)
    assert s._plan is not plan and s._block is block
    check_table(live, s.table(staged), s._block)
    other = state(2)
    other["model"]["small"] = torch.zeros(78, dtype=torch.int64)
    staged = s.stage(other)
    assert s._block is not block
    check_table(other, s.table(staged), s._block)


def test_a_changed_byte_after_the_copy_fails_the_digest():
    s, live = stager(), state(0)
    table = s.table(s.stage(live))
    entry = table["model.big"]
    s._block[entry["offset"] + 5000] ^= 0xFF
    data = s._block[entry["offset"] :][: entry["nbytes"]]
    assert memory.digest(data) != entry["digest"]


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, memory.CHECK_CHUNK + 4100])
def test_the_digest_of_sums_is_the_digest(nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    padded = torch.zeros(-(-nbytes // 4096) * 4096, dtype=torch.uint8)
    padded[:nbytes] = data
    sums = padded.view(torch.int64).view(-1, 512).sum(dim=1).numpy()
    assert memory.checksum.digest_of_sums(sums) == memory.digest(data)


# ---- the state dict, taken once --------------------------------------------------------------
def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))

    def step():
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return model, optimizer, step


def same(got: dict, want: dict) -> None:
    a, b = flatten_state_dict(got)[0], flatten_state_dict(want)[0]
    assert list(a) == list(b)
    for key, value in b.items():
        if isinstance(value, torch.Tensor):
            assert a[key].data_ptr() == value.data_ptr() and torch.equal(a[key], value), key
        else:
            assert a[key] == value, key


def test_the_view_is_dcp_s_state_dict_step_after_step_taken_once():
    model, optimizer, step = trained()
    view = StateView(model, optimizer)
    first = view.get()
    for _ in range(3):
        step()  # the learning rate changes
        got = view.get()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        same(got, {"model": model_sd, "optim": optim_sd})
        assert got["model"] is first["model"] and got["optim"]["state"] is first["optim"]["state"]
    assert view.taken == 1


def test_a_load_or_a_replaced_tensor_takes_the_state_dict_afresh():
    model, optimizer, step = trained()
    view = StateView(model, optimizer)
    view.get()
    optimizer.load_state_dict(optimizer.state_dict())  # a resume, a rollback: new state tensors
    got = view.get()
    assert view.taken == 2
    model_sd, optim_sd = get_state_dict(model, optimizer)
    same(got, {"model": model_sd, "optim": optim_sd})
    moments = optimizer.state[model[0].weight]
    moments["exp_avg"] = moments["exp_avg"].clone()  # one state tensor replaced
    view.get()
    assert view.taken == 3
    with torch.no_grad():
        model[1].bias.data = torch.zeros(16)  # the same parameter, another storage
    got = view.get()
    assert view.taken == 4
    model_sd, optim_sd = get_state_dict(model, optimizer)
    same(got, {"model": model_sd, "optim": optim_sd})
    view.get()
    assert view.taken == 4


# ---- the copy's pieces, shared --------------------------------------------------------------
def test_pieces_taken_by_two_threads_make_the_same_copy():
    s, live = stager(), state(0)
    job = s.start(live)
    helper = threading.Thread(target=job.work)
    helper.start()
    job.work()
    helper.join()
    staged = s.finish(live, job)
    check_table(live, s.table(staged), s._block)
    assert job.done.is_set() and job.error is None


def test_a_piece_that_fails_fails_the_copy():
    s, live = stager(), state(0)
    job = s.start(live)
    job._pieces[1] = ([torch.empty(3)], [torch.empty(4)], *job._pieces[1][2:])  # cannot copy
    job.work()
    assert job.done.is_set() and job.error is not None
    with pytest.raises(RuntimeError):
        s.finish(live, job)


def test_the_loop_finishes_a_copy_its_worker_has_not_started(tmp_path):
    """The copy worker busy (or starved): `wait_copied` does every piece itself, and the slot
    is sealed and loads as it should."""
    model, optimizer = trained_linear()
    expect = memory.Expect("j", 0, 1, "m", "f", "node0")
    t = cpu_tier(tmp_path, model, optimizer, expect)
    release = threading.Event()
    t._worker.submit(release.wait)  # the worker stuck behind something else
    t.save(3, 6, {})
    copied = t.wait_copied()
    assert copied is not None and copied.step == 3
    release.set()
    deadline = time.monotonic() + 30
    while t.sealed != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    t.close(remove=False)
    (held,), refused = memory.find(tmp_path, expect)
    assert held.step == 3 and refused == ["slot 1: missing"], refused  # one copy made
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    loader = cpu_tier(tmp_path, model, optimizer, expect)
    loader.load(held, Scheduler())
    loader.close(remove=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
