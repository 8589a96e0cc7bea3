"""How long a fault injection to many ranks stalls the supervisor's event loop.

The real FaultEngine fires one `stall` (carried by the control channel) at every rank of a
simulated job. The ranks are ZeroMQ DEALER sockets in a process of their own (so they connect in
real time whatever the loop does, and take no GIL from it): some connected before the fault,
some connecting just after it, some never. A 1 ms asyncio timer measures the loop's longest
stall (how late a wake-up came) around the injection: heartbeat intake and every deadline of the
supervisor wait that long.

Usage: python bench/fault_loop_lag.py [--ranks 64] [--late 16] [--never 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import time

import zmq

from contracts import messages
from faults import FaultEngine
from faults.spec import JobShape, parse_all
from supervisor.watch.control import ControlServer
from supervisor.watch.rank_table import AttemptTable
from worker.control_channel import ControlChannel

KEY = b"bench-key-" * 4
JOB = "lag"
TICK_S = 0.001


def ranks(address: str, early: range, late: range, ready, fired, done, got) -> None:
    """The ranks' control sockets: `early` connect at once, `late` 50 ms after the fault."""
    ctx = zmq.Context()
    socks = {r: _connect(ctx, address, r) for r in early}
    time.sleep(0.3)  # the ROUTER learns each routing id once the handshake is done
    ready.set()
    fired.wait()
    time.sleep(0.05)
    socks.update({r: _connect(ctx, address, r) for r in late})
    heard: set[int] = set()
    poller = zmq.Poller()
    for s in socks.values():
        poller.register(s, zmq.POLLIN)
    by_sock = {s: r for r, s in socks.items()}
    while not done.is_set():
        for s, _ in poller.poll(10):
            s.recv_multipart()
            heard.add(by_sock[s])
    got.value = len(heard)
    for s in socks.values():
        s.close(linger=0)
    ctx.term()


def _connect(ctx: zmq.Context, address: str, rank: int) -> zmq.Socket:
    """A rank's real end of the channel (CURVE with the job's keys, its hello)."""
    ident = messages.RankIdentity(JOB, 0, rank, 1, "bench", os.getpid())
    return ControlChannel(address, KEY, ident).open(ctx, zmq)


async def once(world: int, late: int, never: int) -> dict[str, float]:
    events: list[dict] = []
    specs = parse_all([{"at_step": 1, "action": "stall"}], "bench", JobShape(world=world, nodes=1))
    control = ControlServer(KEY, JOB, "127.0.0.1", "127.0.0.1")
    engine = FaultEngine(
        specs, job_id=JOB, world=world, ranks_per_node=world, ckpt_dir=None,
        this_host=socket.gethostname(), emit=lambda e, **kw: events.append({"event": e, **kw}),
        control=control, owns_control=True,
    )  # fmt: skip
    early = world - late - never
    ready, fired, done, got = mp.Event(), mp.Event(), mp.Event(), mp.Value("i", 0)
    sim = mp.Process(
        target=ranks,
        args=(control.address, range(early), range(early, early + late), ready, fired,
              done, got),
    )  # fmt: skip
    sim.start()
    await asyncio.to_thread(ready.wait)
    table = AttemptTable(attempt=0, world=world, launched_at=0.0)
    host = socket.gethostname()
    for r in range(world):
        msg = {"attempt": 0, "rank": r, "world": world, "host": host, "pid": 1, "t": 0.0}
        table.update({**msg, "kind": "hello", "phase": "init"}, 0.0)
        table.update({**msg, "kind": "step", "step": 1, "loss": 1.0, "dt": 0.1}, 0.0)
        table.update({**msg, "kind": "phase", "phase": "train", "step": 1}, 0.0)
    engine.attempt_started(0)

    worst = 0.0
    stop = False

    async def watch() -> None:
        nonlocal worst
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(TICK_S)
            worst = max(worst, time.perf_counter() - t - TICK_S)

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    idle, worst = worst, 0.0  # the noise floor (this host's load); from here on: the injection
    fired.set()  # the late ranks connect 50 ms from now
    t0 = time.perf_counter()
    engine.fire_due(table, time.monotonic())
    fire_s = time.perf_counter() - t0
    await asyncio.sleep(0.6)  # the retries (0.2 s at most) and then some
    stop = True
    await watcher
    done.set()
    await asyncio.to_thread(sim.join)
    engine.close()
    fault = next(e for e in events if e["event"] == "fault")
    undelivered = sum(len(e["ranks"]) for e in events if e["event"] == "fault_undelivered")
    errors = len(fault.get("errors", ()))
    return {
        "stall_ms": worst * 1e3,
        "idle_ms": idle * 1e3,
        "fire_ms": fire_s * 1e3,
        "delivered": got.value,
        "undelivered": undelivered + errors,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--late", type=int, default=16, help="ranks connecting 50 ms after the fault")
    ap.add_argument("--never", type=int, default=16, help="ranks that never connect")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    runs = [asyncio.run(once(args.ranks, args.late, args.never)) for _ in range(args.repeat)]
    early = args.ranks - args.late - args.never
    print(f"{args.ranks} ranks: {early} connected, {args.late} connecting 50 ms after the fault, "
          f"{args.never} never; {args.repeat} runs")  # fmt: skip
    for key in ("stall_ms", "fire_ms", "idle_ms"):
        values = [r[key] for r in runs]
        print(f"  {key:9s} median {statistics.median(values):9.2f}  max {max(values):9.2f}")
    print(f"  delivered {[r['delivered'] for r in runs]}  undelivered "
          f"{[r['undelivered'] for r in runs]}")  # fmt: skip


if __name__ == "__main__":
    main()
