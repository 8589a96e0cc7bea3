"""The worker's checkpoint intervals (worker.intervals): when a copy or save is due, what rank 0
puts into the step's agreement and how every rank adopts it, a rank tuning itself from the prior
until the supervisor speaks, the supervisor's word at a launch and by command, and the flags.
No processes: the agreement's all-reduce is the sum of what each rank offers, done here by hand.
"""

from __future__ import annotations

import pytest

from contracts import control_msgs, intervals, messages
from contracts.env_names import ENV_MEM_CKPT_INTERVAL, ENV_SAVE_INTERVAL
from contracts.intervals import AUTO, DURABLE, MEMORY
from worker import args as worker_args
from worker.errors import UsageError
from worker.intervals import Intervals

BASE = ["--model", "debug", "--ckpt-dir", "/tmp/x"]


def ranks(memory="auto", durable=0, env=None, world=2, prior=100.0, memory_on=True):
    return [
        Intervals(
            {MEMORY: memory, DURABLE: durable},
            rank=r,
            memory_on=memory_on,
            prior_mtbf_s=prior,
            max_steps=1000,
            env=env or {},
        )
        for r in range(world)
    ]


def agree(all_ranks: list[Intervals], step: int) -> None:
    """The step's all-reduce: every rank adopts the sum of what each offered."""
    offers = [r.offer(step) for r in all_ranks]
    summed = [sum(values) for values in zip(*offers, strict=True)]
    for r in all_ranks:
        r.agreed(summed)


def test_a_fixed_interval_is_a_multiple_and_0_is_off():
    (r,) = ranks(memory=5, durable=0, world=1)
    assert [s for s in range(1, 21) if r.due(MEMORY, s)] == [5, 10, 15, 20]
    assert not any(r.due(DURABLE, s) for s in range(1, 21))
    assert r.offer(3) == [0.0, 0.0]  # nothing of a fixed tier goes into the agreement


def test_auto_copies_at_the_first_steps_to_measure_then_waits_for_a_tuned_interval():
    (r,) = ranks(world=1, durable=AUTO)
    r.begin(11)  # resumed from step 10
    # The memory tier's first copies are cold (its set-up, each slot's first fill, the CPU of
    # the one before counted with the next): its fourth is the measure.
    assert [s for s in range(11, 30) if r.due(MEMORY, s)] == [11, 12, 13, 14]
    assert [s for s in range(11, 30) if r.due(DURABLE, s)] == [11]
    (off,) = ranks(world=1, memory_on=False)  # "auto" without --ckpt-dir: no memory tier
    assert not any(off.due(MEMORY, s) for s in range(1, 30))


def test_auto_counts_from_the_last_copy_so_a_change_leaves_no_longer_gap():
    world = ranks()
    for r in world:
        r.begin(1)
    due = []
    for step in range(1, 31):
        if step == 6:
            world[0].told(MEMORY, 5, from_step=6)
        if step == 18:
            world[0].told(MEMORY, 7, from_step=18)
        agree(world, step)
        said = [r.due(MEMORY, step) for r in world]
        assert said[0] == said[1], step
        due += [step] if said[0] else []
    assert due == [1, 2, 3, 4, 9, 14, 21, 28]  # 14 + 7, not the next multiple of 7
    for r in world:  # the guard rolled back to step 12: counted from the step before it
        assert not r.due(MEMORY, 12) and [s for s in range(13, 21) if r.due(MEMORY, s)] == [18]
    resumed = ranks(env={ENV_MEM_CKPT_INTERVAL: "7"})
    for r in resumed:
        r.begin(41)  # resumed from step 40
    assert [s for s in range(41, 60) if resumed[0].due(MEMORY, s)] == [47, 54]


def test_rank_0_tunes_itself_from_the_prior_and_every_rank_adopts_it_at_the_same_step():
    world = ranks(prior=100.0)
    for r in world:
        r.begin(1)
    agree(world, 1)
    costs = {2: {MEMORY: 0.3}, 3: {MEMORY: 0.1}, 4: {MEMORY: 0.05}, 5: {MEMORY: 0.02}}  # cold x3
    for step in range(1, 7):  # 0.1 s steps
        for r in world:
            sampled = r.after_step(step, 0.1, costs.get(step, {}))
            assert sampled == ({MEMORY: 0.02} if step == 5 else {})  # what rank 0 tells
    want = intervals.interval_steps(0.02, 0.1, 100.0, 1000)
    assert world[0].tiers[MEMORY].proposed == want
    assert world[1].tiers[MEMORY].proposed is None  # only rank 0's word counts
    assert [r.every(MEMORY) for r in world] == [None, None]  # not before the agreement
    agree(world, 7)
    assert [r.every(MEMORY) for r in world] == [want, want]
    assert world[0].take_changed() == {MEMORY: want} == world[1].take_changed()
    assert all(r.due(MEMORY, want * 3) and not r.due(MEMORY, want * 3 + 1) for r in world)


def test_the_supervisors_word_applies_from_its_step_and_stops_the_ranks_own_tuning():
    world = ranks()
    for r in world:
        r.begin(1)
    world[0].told(MEMORY, 7, from_step=5)
    agree(world, 4)
    assert [r.every(MEMORY) for r in world] == [None, None]
    agree(world, 5)
    assert [r.every(MEMORY) for r in world] == [7, 7]
    for step in range(5, 12):
        world[0].after_step(step, 0.1, {MEMORY: 0.5})
    agree(world, 12)
    assert world[0].every(MEMORY) == 7  # told: its own measures no longer move it
    world[0].told(MEMORY, 3, from_step=2)  # late: at the next step it runs
    agree(world, 13)
    assert [r.every(MEMORY) for r in world] == [3, 3]


def test_a_launch_starts_with_the_supervisors_interval():
    world = ranks(durable=AUTO, env={ENV_MEM_CKPT_INTERVAL: "9", ENV_SAVE_INTERVAL: "40"})
    assert all(r.every(MEMORY) == 9 and r.every(DURABLE) == 40 for r in world)
    assert all(r.tiers[MEMORY].steered for r in world)
    with pytest.raises(UsageError, match=ENV_SAVE_INTERVAL):
        ranks(durable=AUTO, env={ENV_SAVE_INTERVAL: "0"})


def test_a_cold_copy_for_each_memory_slot():
    from worker.ckpt.memory.slot_file import SLOTS
    from worker.intervals import COLD_COPIES

    # One for each slot's first fill, and one more: the next copy's figure carries the seal and
    # partner send of the one before (the tier's threads' CPU, counted since the copy before).
    assert COLD_COPIES[MEMORY] == SLOTS + 1 and COLD_COPIES[DURABLE] == 0


def test_the_flags_take_auto_and_numbers():
    a = worker_args.parse_args([*BASE, "--save-interval", "auto"])
    assert a.save_interval == AUTO and a.mem_ckpt_interval == AUTO  # the memory tier's default
    assert worker_args.parse_args([*BASE, "--mem-ckpt-interval", "3"]).mem_ckpt_interval == 3
    assert worker_args.parse_args(["--model", "debug"]).mem_ckpt_interval == AUTO  # off: no dir
    with pytest.raises(UsageError, match="need --ckpt-dir"):
        worker_args.parse_args(["--save-interval", "auto"])
    with pytest.raises(UsageError, match='expected a number of steps or "auto"'):
        worker_args.parse_args([*BASE, "--mem-ckpt-interval", "often"])
    with pytest.raises(UsageError, match="--mtbf-prior-s must be seconds > 0"):
        worker_args.parse_args([*BASE, "--mtbf-prior-s", "0"])


def test_the_interval_command_is_checked():
    key = b"k" * 32
    good = control_msgs.control_message("j", 1, 0, 1.0, "interval", 0, step=5, tier="memory",
                                        interval=4)  # fmt: skip
    frame = messages.encode(key, good)
    assert control_msgs.decode_control(key, frame, "j", 1, 0)["interval"] == 4
    for bad in ({"tier": "disk"}, {"interval": 0}):
        frame = messages.encode(key, {**good, **bad})
        with pytest.raises(messages.BadMessage):
            control_msgs.decode_control(key, frame, "j", 1, 0)
