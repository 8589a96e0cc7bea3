"""A bad step never reaches the weights: the loop's own `train_step`, on one rank's gloo group,
with a NaN put into a gradient (the `nan` fault's path) and with a spiked loss."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from contracts.intervals import DURABLE, MEMORY
from worker.beat import Beacon
from worker.ckpt.manager import CheckpointManager
from worker.data import SyntheticData
from worker.guard import Baseline, Due, GuardConfig, Injected
from worker.guard import injected_due as due_of
from worker.guard_step import GuardRun
from worker.intervals import Intervals
from worker.loop import train_step
from worker.metrics import MetricsLog
from worker.model import Transformer
from worker.presets import resolve_config

SIZES = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
         "vocab_size": 64, "seq_len": 16}  # fmt: skip


NO_CHECKPOINTS = Intervals(
    {MEMORY: 0, DURABLE: 0}, rank=0, memory_on=False, prior_mtbf_s=1.0, max_steps=10, env={}
)


def training(warmup: int = 2) -> SimpleNamespace:
    torch.manual_seed(0)
    cfg = resolve_config("debug", **SIZES)
    model = Transformer(cfg)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return SimpleNamespace(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        source=SyntheticData(cfg.vocab_size, cfg.seq_len, seed=0),
        guard=GuardRun(GuardConfig("skip", warmup=warmup)),
        args=SimpleNamespace(batch_size=2, grad_clip=1.0),
        info=SimpleNamespace(rank=0, world=1),
        device=torch.device("cpu"),
        dp_rank=0,
        ckpt=CheckpointManager(),
        metrics=MetricsLog(None),
        intervals=NO_CHECKPOINTS,
        beacon=Told(),
    )


def state(t: SimpleNamespace) -> list[torch.Tensor]:
    moments = [v.clone() for s in t.optimizer.state.values() for v in s.values()]
    return [p.detach().clone() for p in t.model.parameters()] + moments


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("fault", "step", "kind"), [("nan", 3, "nan"), ("spike", 3, "spike")])
def test_a_bad_step_leaves_weights_optimizer_and_schedule_as_they_were(
    one_rank_group, fault, step, kind
):
    t = training()
    for s in (1, 2):
        assert train_step(t, s, False).verdict is None
    before, lr_step = state(t), t.scheduler.last_epoch
    t.guard.pending.append(Injected(step, fault, 1e4, fault=2))
    done = train_step(t, step, False)
    assert done.verdict is not None and done.verdict.kind == kind
    assert t.beacon.acks == [(2, step, fault, True, step)]  # the supervisor's `fault` waits
    assert same(state(t), before)
    assert t.scheduler.last_epoch == lr_step
    assert all(p.grad is None for p in t.model.parameters())
    # the next good step moves the weights again, and finitely
    assert train_step(t, step, False).verdict is None
    assert not same(state(t), before)
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


def test_a_good_step_is_applied_and_moves_the_baseline(one_rank_group):
    t = training()
    before = state(t)
    done = train_step(t, 1, False)
    assert done.verdict is None and math.isfinite(done.mean_loss)
    assert not same(state(t), before)
    assert t.guard.baseline.good == 1 and t.guard.baseline.loss == done.mean_loss


def test_a_resumed_run_takes_the_checkpoints_ranges_and_baseline_with_the_flags():
    """What a checkpoint's data record holds of the guard comes back as it was saved, merged
    with `--skip-batches`; a record without it (an older checkpoint) starts the baseline afresh."""
    cfg = GuardConfig("rollback", warmup=2)
    saved = GuardRun(cfg, ((3, 3), (8, 10)), Baseline(5, 2.5, 0.75))
    data = json.loads(json.dumps({"kind": "SyntheticData", "next_step": 13, **saved.record()}))
    resumed = GuardRun.start(cfg, "20-21", data, [])
    assert resumed.ranges == ((3, 3), (8, 10), (20, 21)) and resumed.baseline == saved.baseline
    assert [resumed.position(s) for s in (2, 3, 6, 16)] == [2, 4, 7, 22]
    fresh = GuardRun.start(cfg, "", {"kind": "SyntheticData", "next_step": 5}, [])
    assert fresh.ranges == () and fresh.baseline == Baseline()


def test_an_injected_fault_acts_once_at_its_very_step_and_a_late_one_never():
    """Issue 40: a command that came late acted at the next step, where the next point's
    landed too: two points, one bad step. Now each acts at its step or is dropped (and said)."""
    spike, nan, late = Injected(3, "spike", 8.0, 0), Injected(5, "nan", 1.0, 0), Injected(4, "nan")
    run = GuardRun(GuardConfig("skip"), pending=[nan, spike])
    assert run.due(2) == Due()
    assert run.due(3) == Due(8.0, False, (spike,))
    run.pending.append(late)  # came while the rank was in step 4: not applied at step 5
    assert run.due(5) == Due(1.0, True, (nan,), (late,))
    assert run.due(5) == Due() and run.pending == []  # a redone step is not poisoned again
    both = [Injected(6, "nan", fault=0), Injected(6, "spike", 10.0, 1), Injected(7, "nan", 1)]
    assert due_of(both, 6) == (Due(10.0, True, tuple(both[:2])), both[2:])


class Told(Beacon):
    """The no-op beacon, keeping what the rank said of the supervisor's commands."""

    def __init__(self):
        self.acks = []

    def fault_ack(self, fault, step, action, applied, at):
        self.acks.append((fault, step, action, applied, at))
