"""The warm standby's parts without a launcher: the RNG round-trip, the warm-up's promise (a
warmed model's first step equals a cold one's, bit for bit, in a one-rank gloo group of this
process), the beacon's wait for go / exit / a stop, the environment check, the startup clock."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zmq

from contracts import control_msgs, env_names, messages
from supervisor.watch.control import ControlServer
from worker import startup as S
from worker.args import parse_args, plan_run
from worker.beat import Beacon, ZmqBeacon
from worker.build import (
    Setup,
    build_state,
    defers_init,
    draw_fresh,
    intervals_of,
    join_group,
)
from worker.ckpt import rng
from worker.dist import RankInfo
from worker.errors import UsageError
from worker.guard import GuardConfig
from worker.guard_step import GuardRun
from worker.loop import train_step
from worker.metrics import MetricsLog
from worker.standby import warm_up, warm_update
from worker.train import standby_requested

TINY = "--dim 32 --n-layers 2 --n-heads 4 --n-kv-heads 2 --ffn-dim 64 --vocab-size 128 --seq-len 32"


def draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_rng_states_round_trip():
    saved = rng.states("cpu")
    first = draws()
    assert draws() != first  # the generators moved on
    rng.set_states(saved)
    assert draws() == first
    rng.set_states(saved)
    assert rng.restore(rng.capture("cpu")) is None and draws() == first  # the text form too


# --- the warm-up, in a one-rank gloo group -------------------------------------------------------
@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("MASTER_ADDR", "MASTER_PORT", env_names.ENV_ATTEMPT_DIR):
        monkeypatch.delenv(name, raising=False)
    args = parse_args([*TINY.split(), "--outdir", str(tmp_path), "--device", "cpu"])
    cfg, layout = plan_run(args, 1)
    info = RankInfo(0, 1, 0, 1, "single", "localhost")
    setup = Setup(args, info, cfg, layout, Beacon(), lambda *a, **k: None, S.Startup())
    group = join_group(setup)
    yield setup, group
    dist.destroy_process_group()


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Bit for bit (a -0.0 that became 0.0 would count)."""
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return all(torch.equal(bits(x), bits(y)) for x, y in pairs)


def bits(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor().detach().contiguous().view(torch.int32)


def test_warm_up_changes_nothing_the_run_computes(one_rank):
    setup, group = one_rank
    cold = build_state(setup, group)
    warm = build_state(setup, group)  # the same seed: the same model
    before = rng.states("cpu")
    warm_up(setup, group, warm)
    after = rng.states("cpu")
    assert torch.equal(before["torch"], after["torch"])
    assert before["python"] == after["python"]
    assert (before["numpy"][1] == after["numpy"][1]).all()
    assert all(p.grad is None for p in warm.model.parameters())
    assert not warm.optimizer.state  # the update ran on copies: the optimizer has no state
    assert same_params(cold.model, warm.model)
    assert "startup/warmup" in setup.startup.parts

    class T:  # what train_step reads of a Training
        def __init__(self, state):
            self.source, self.model, self.optimizer = state.source, state.model, state.optimizer
            self.scheduler, self.args, self.device = state.scheduler, setup.args, group.device
            self.dp_rank, self.info = 0, SimpleNamespace(rank=0, world=1)
            self.ckpt = type("NoCkpt", (), {"before_update": lambda self: None})()
            self.guard, self.metrics = GuardRun(GuardConfig("skip")), MetricsLog(None)
            self.intervals = intervals_of(setup.args, 0)

    for step in (1, 2, 3):
        lc, lw = train_step(T(cold), step, False), train_step(T(warm), step, False)
        assert lc.loss == lw.loss and lc.verdict is None is lw.verdict, step
    assert same_params(cold.model, warm.model)


def test_a_model_built_undrawn_gets_the_values_of_a_fresh_start(one_rank):
    """A standby on CPU builds its model without drawing (a load will set it); when nothing is
    loaded after all, it gets what a cold fresh start draws, and the generator where it left."""
    setup, group = one_rank
    assert defers_init(group)
    cold = build_state(setup, group)
    after_cold = torch.get_rng_state()
    undrawn = build_state(setup, group, draw=False)
    assert not undrawn.drawn
    assert all(not bits(p).any() for p in undrawn.model.parameters())  # zeros until drawn
    assert torch.equal(undrawn.model.rope_cos, cold.model.rope_cos)  # no checkpoint holds it
    warm_up(setup, group, undrawn)
    draw_fresh(setup, group, undrawn.model)
    assert same_params(cold.model, undrawn.model)
    assert torch.equal(torch.get_rng_state(), after_cold)


def test_the_warm_update_copies_one_parameter_of_each_kind():
    made = []

    class Recording(torch.optim.AdamW):  # says how many parameters each group it is made with has
        def __init__(self, groups, **kw):
            made.append([len(g["params"]) for g in groups])
            super().__init__(groups, **kw)

    def linears(*shapes):
        return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]

    plain, listed = linears((8, 8), (8, 8), (8, 8), (4, 8)), linears((8, 8), (8, 8))
    for p in plain + listed:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in plain + listed]
    optimizer = Recording([{"params": plain}, {"params": listed, "foreach": True}], lr=0.1)
    warm_update(optimizer)
    # Two kinds in the first group; a foreach group is one op over its list: all of it.
    assert made == [[4, 2], [2, 2]]
    assert all(torch.equal(p, b) for p, b in zip(plain + listed, before, strict=True))
    assert not optimizer.state


# --- the beacon's wait ----------------------------------------------------------------------------
@pytest.fixture
def control():
    """The supervisor's real control socket, a PULL for the beats, and a standby's beacon
    (attempt 4, rank 1) connected to both."""
    ctx = zmq.Context()
    key = b"k" * 32
    server = ControlServer(key, "job", "127.0.0.1", "127.0.0.1")
    pull = ctx.socket(zmq.PULL)
    p_port = pull.bind_to_random_port("tcp://127.0.0.1")
    ident = messages.RankIdentity("job", 4, 1, 2, "h", 1)
    beacon = ZmqBeacon(f"tcp://127.0.0.1:{p_port}", key, ident, 0.05, server.address)

    def send(action: str, key: bytes = key, attempt: int = 4, env=None) -> None:
        frame = messages.encode(
            key, control_msgs.control_message("job", attempt, 1, time.time(), action, 0, env=env)
        )
        deadline = time.monotonic() + 10
        while (conn := server.owner(4, 1)) is None:  # not connected yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server._sock.send_multipart([conn, frame])  # as signed here, whatever it says

    yield beacon, send
    beacon.close()
    pull.close(0)
    ctx.term()
    server.close()


@pytest.mark.parametrize("action", ["go", "exit"])
def test_wait_returns_the_verified_command(control, action):
    beacon, send = control
    send(action, key=b"x" * 32)  # wrongly signed: dropped
    send(action, attempt=3)  # another attempt's: dropped
    send(action)
    t0 = time.monotonic()
    assert beacon.wait_standby_command(lambda: False)["action"] == action
    assert time.monotonic() - t0 < 5
    assert beacon.control_dropped == 2


def test_a_become_brings_its_variables(control):
    """A prepared rank's `become`: the rank's variables, as signed."""
    beacon, send = control
    send("become", env={"RANK": "2", "WORLD_SIZE": "3"})
    cmd = beacon.wait_standby_command(lambda: False)
    assert (cmd["action"], cmd["env"]) == ("become", {"RANK": "2", "WORLD_SIZE": "3"})


def test_a_stop_ends_the_wait_promptly(control):
    beacon, _ = control
    asked = time.monotonic() + 0.3
    assert beacon.wait_standby_command(lambda: time.monotonic() > asked)["action"] == "stop"
    assert time.monotonic() - asked < 0.5


def test_only_a_beacon_with_a_control_channel_can_wait():
    with pytest.raises(UsageError, match="ES_CONTROL_ADDR"):
        Beacon().wait_standby_command(lambda: False)


def test_standby_needs_the_supervisors_channels():
    full = {
        env_names.ENV_STANDBY: "1",
        env_names.ENV_HEARTBEAT_ADDR: "tcp://h:1",
        env_names.ENV_CONTROL_ADDR: "tcp://h:2",
    }
    assert standby_requested(full)
    assert not standby_requested({})
    assert not standby_requested({**full, env_names.ENV_STANDBY: "0"})
    with pytest.raises(UsageError, match="ES_STANDBY=1 without ES_CONTROL_ADDR"):
        standby_requested({k: v for k, v in full.items() if k != env_names.ENV_CONTROL_ADDR})


def test_a_warm_start_counts_its_restart_from_go(monkeypatch):
    now = [S.PROCESS_START + 5.0]
    monkeypatch.setattr(S.time, "time", lambda: now[0])
    st = S.Startup()
    st.mark("imports")
    st.ready()
    now[0] += 30.0  # waiting
    st.mark("standby_wait")
    st.go()
    now[0] += 0.25
    st.mark("load")
    assert st.prepare_seconds == 5.0
    assert st.parts["startup/standby_wait"] == 30.0
    assert st.total == pytest.approx(0.25)
