"""The shrink plan: what the worker's flags become on fewer ranks (pure, no processes)."""

from __future__ import annotations

import json

import pytest

from supervisor.settings import worker_spec
from supervisor.settings.config import flags_from_table
from worker import args as worker_args
from worker.layout import plan_layout

TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "seq_len": 32}
SPEC = worker_spec.load("worker.train")


def plan_shrink(table: dict, world: int, new_world: int):
    """The plan for a `[worker]` table, asked for as the supervisor asks (its flags)."""
    return SPEC.plan_shrink(flags_from_table(table), world, new_world)


def test_fsdp_3_to_2_raises_the_batch_and_keeps_the_global_batch():
    plan = plan_shrink({**TINY, "batch_size": 2}, 3, 2)
    assert plan.problem is None
    assert plan.flags == {"batch_size": 3}
    assert plan.batch_kept
    assert plan.global_batch == (6, 6)
    assert plan.tokens_per_step == (6 * 32, 6 * 32)
    assert plan.mesh == ("dp_shard=3", "dp_shard=2")
    assert "batch_size 2 -> 3 per data-parallel rank: global batch kept at 6" in plan.changes[1]


def test_absent_flags_are_the_workers_defaults():
    """No batch_size in the table: the worker's default (2) is what the global batch is of."""
    default = worker_args.parse_args([]).batch_size
    plan = plan_shrink({}, 4, 2)
    assert plan.flags == {"batch_size": 2 * default}
    assert plan.tokens_per_step[0] == 4 * default * 256  # the debug preset's seq_len


def test_a_batch_that_does_not_divide_keeps_batch_size_and_says_what_changed():
    plan = plan_shrink({**TINY, "batch_size": 1}, 4, 3)
    assert plan.problem is None
    assert plan.flags == {}
    assert not plan.batch_kept
    assert plan.global_batch == (4, 3)
    assert plan.tokens_per_step == (128, 96)
    assert any("global batch 4 -> 3 sequences (128 -> 96 tokens)" in c for c in plan.changes)
    assert any("no gradient accumulation" in c for c in plan.changes)


def test_tp_is_kept_and_data_parallel_shrinks():
    plan = plan_shrink({**TINY, "tp": 2}, 6, 4)
    assert plan.problem is None
    assert plan.flags == {"batch_size": 3}  # dp 3 x 2 = 6 sequences, dp 2 x 3
    assert plan.mesh == ("dp_shard=3xtp=2", "dp_shard=2xtp=2")
    assert "tp 2 kept" in plan.changes[0]


def test_tp_ranks_share_a_batch():
    """Ranks of one tensor-parallel group take the same slice: the global batch is dp x
    batch_size, not world x batch_size."""
    plan = plan_shrink({**TINY, "tp": 2, "batch_size": 2}, 8, 4)
    assert plan.global_batch == (8, 8)
    assert plan.flags == {"batch_size": 4}


def test_tp_down_to_one_data_parallel_rank():
    plan = plan_shrink({**TINY, "tp": 2}, 4, 2)
    assert plan.problem is None
    assert plan.flags == {"batch_size": 4}
    assert plan.mesh[1] == "tp=2"


def test_tp_that_does_not_divide_the_new_world_is_a_problem_with_the_fix():
    plan = plan_shrink({**TINY, "tp": 2}, 4, 3)
    assert plan.problem is not None
    assert "tp 2 does not divide the 3 ranks left" in plan.problem
    assert "multiple of 2" in plan.problem
    assert plan.flags == {} and not plan.batch_kept


def test_fewer_ranks_than_tp_is_a_problem():
    plan = plan_shrink({**TINY, "n_kv_heads": 4, "tp": 4}, 8, 2)
    assert "tp 4 does not divide the 2 ranks left" in plan.problem


def test_no_ranks_left_is_a_problem():
    assert "no ranks left" in plan_shrink(TINY, 2, 0).problem


def test_hsdp_replicate_kept_when_it_divides():
    plan = plan_shrink({**TINY, "replicate": 2}, 8, 4)
    assert plan.problem is None
    assert "replicate" not in plan.flags
    assert plan.flags == {"batch_size": 4}
    assert plan.mesh == ("dp_replicate=2xdp_shard=4", "dp_replicate=2xdp_shard=2")


def test_hsdp_replicate_kept_down_to_one_shard():
    """dp 2 with 2 replicas leaves shards of one rank: the worker's layout allows it."""
    plan = plan_shrink({**TINY, "replicate": 2}, 4, 2)
    assert plan.problem is None
    assert "replicate" not in plan.flags
    assert plan.mesh[1] == "dp_replicate=2"
    assert plan_layout(2, 1, 2).shard == 1


def test_hsdp_replicate_lowered_to_the_largest_that_divides():
    plan = plan_shrink({**TINY, "replicate": 4, "batch_size": 1}, 8, 6)
    assert plan.flags == {"replicate": 3}  # 8 sequences do not divide by 6: batch_size kept
    assert any("replicate 4 -> 3" in c for c in plan.changes)
    assert plan.global_batch == (8, 6) and not plan.batch_kept


def test_hsdp_replicate_lowered_to_one():
    plan = plan_shrink({**TINY, "replicate": 2, "batch_size": 3}, 4, 3)
    assert plan.flags == {"replicate": 1, "batch_size": 4}
    assert plan.batch_kept and plan.global_batch == (12, 12)
    assert plan.mesh[1] == "dp_shard=3"


def test_hsdp_with_tp():
    plan = plan_shrink({**TINY, "replicate": 2, "tp": 2, "batch_size": 3}, 12, 8)
    assert plan.problem is None
    assert plan.flags == {}  # replicate 2 still divides dp 4
    assert not plan.batch_kept  # 18 sequences among 4 data-parallel ranks
    assert plan.global_batch == (18, 12)


def test_planned_from_the_original_world_each_time():
    """A second shrink is planned from the first world and flags, not from the first plan."""
    flags = {**TINY, "batch_size": 1}
    first = plan_shrink(flags, 6, 3)
    second = plan_shrink(flags, 6, 2)
    assert first.flags == {"batch_size": 2}
    assert second.flags == {"batch_size": 3}
    assert second.global_batch == (6, 6)


def test_the_same_world_changes_nothing():
    plan = plan_shrink({**TINY, "tp": 2}, 4, 4)
    assert plan.problem is None and plan.flags == {} and plan.changes == () and plan.batch_kept


def test_a_plan_the_worker_refuses_is_a_problem():
    """tp 4 against n_kv_heads 2: the worker's own check speaks, not a launch that fails."""
    plan = plan_shrink({**TINY, "tp": 4}, 8, 4)
    assert plan.problem is not None
    assert "--tp 4 does not divide n_kv_heads=2" in plan.problem


def test_unknown_flags_are_a_problem_not_an_exception():
    assert "unrecognized" in plan_shrink({"batch_sise": 2}, 2, 1).problem


def test_other_flags_pass_through_untouched():
    table = {**TINY, "save_interval": 5, "ckpt_dir": "/x", "async_ckpt": True, "lr": 0.01}
    plan = plan_shrink(table, 3, 2)
    assert plan.flags == {"batch_size": 3}


def test_the_event_is_json():
    plan = plan_shrink({**TINY, "batch_size": 1}, 4, 3)
    event = json.loads(json.dumps(plan.event()))
    assert event["world"] == [4, 3]
    assert event["batch_kept"] is False
    assert event["global_batch"] == [4, 3]
    assert event["problem"] is None


@pytest.mark.parametrize("world,new_world", [(w, n) for w in range(1, 9) for n in range(1, w)])
@pytest.mark.parametrize("tp,replicate,batch_size", [(1, 1, 2), (2, 1, 1), (1, 2, 3), (2, 2, 2)])
def test_every_plan_is_one_the_worker_accepts(world, new_world, tp, replicate, batch_size):
    table = {**TINY, "tp": tp, "replicate": replicate, "batch_size": batch_size}
    if world % (tp * replicate):
        return
    plan = plan_shrink(table, world, new_world)
    if new_world % tp:
        assert plan.problem
        return
    assert plan.problem is None
    args = worker_args.parse_args(
        [f"--{k.replace('_', '-')}={v}" for k, v in {**table, **plan.flags}.items()]
    )
    layout = plan_layout(new_world, args.tp, args.replicate)
    assert args.tp == tp
    assert plan.global_batch[1] == layout.dp * args.batch_size
    assert plan.batch_kept == (plan.global_batch[0] == plan.global_batch[1])
