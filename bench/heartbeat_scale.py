"""How many ranks one supervisor holds: heartbeats at 1 Hz, straight from every rank or through
one relay per node.

The supervisor's side is the real thing, in this process: the real HeartbeatServer verifies
every message and folds it into the real AttemptTable, whose `judge` (`liveness.judge_ranks`,
node by node under relays) runs every `check_s` (stretched as the watch loop stretches it).

- Without relays (`--ranks-per-node 1`, or `--no-relay`): simulator processes send, for
  thousands of ranks each, one signed `beat` per rank per second (evenly spread) over a real
  ZeroMQ PUSH socket.
- With relays (`--ranks-per-node N`): the first `--real-relays` nodes are real ones: each a real
  relay (`worker.beat.ZmqBeacon` with `worker.relay.RelayCore`, its own rank beating) bound on
  its real node-local socket, fed every interval by one signed beat per member rank over a real
  PUSH socket. The other nodes' relays are the same `RelayCore`, fed in-process (each rank's
  beat folded in once per interval, as its frame would be), whose signed summaries go over a
  real PUSH socket: as many relays as this host can run, the rest simulated from the same code.

After a warm-up, the supervisor's own CPU time (this process, all threads) is measured over a
window, then one rank is silenced (a member of a real relay's node, with relays) and the time
from its deadline (its last beat + timeout_s) to its `hang` finding is measured. Any other rank
judged lost or stalled is a false positive (the server fell behind).

Usage:
  python bench/heartbeat_scale.py --ranks 100000 --ranks-per-node 100
  python bench/heartbeat_scale.py --table        # 1,000 .. 100,000 ranks, with and without relays
The last line printed is one JSON object (the last run): ranks, nodes, relays, cpu_core_fraction,
hang_found_s, false_positives, and more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time

from contracts import messages
from supervisor.policy.liveness import judge_period
from supervisor.settings.config import HeartbeatConfig, ProgressConfig
from supervisor.watch.heartbeat import HeartbeatServer
from supervisor.watch.rank_table import AttemptTable

KEY = b"bench-key-" * 4
JOB = "scale"
PER_SIMULATOR = 5000  # direct beats: ranks per simulator process
NODES_PER_SIMULATOR = 500  # relays: simulated nodes per simulator process
TABLE = (1_000, 3_000, 10_000, 30_000, 100_000)


def _push(addr: str):
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(addr)
    return ctx, sock


def _paced(n: int, interval: float, conn, send_one) -> None:
    """Call send_one(i, round) for i in 0..n-1 once per interval, evenly spread; answer the
    parent's "silence" (with the monotonic time of item 0's last send) and "stop"."""
    start = time.monotonic()
    rounds = next_i = 0
    silenced = False
    last_0 = start
    while True:
        if conn.poll():
            cmd = conn.recv()
            if cmd == "silence":
                silenced = True
                conn.send(last_0)
            elif cmd == "stop":
                return
        due = int((time.monotonic() - start) / interval * n) - rounds * n
        while next_i < min(due, n):
            if not (silenced and next_i == 0):
                send_one(next_i, rounds)
                if next_i == 0:
                    last_0 = time.monotonic()
            next_i += 1
        if next_i >= n:
            next_i = 0
            rounds += 1
            continue
        time.sleep(0.005)


def simulate_ranks(addr: str, lo: int, hi: int, world: int, interval: float, conn) -> None:
    """Direct beats for ranks [lo, hi); `silence` stops rank `lo`."""
    ctx, sock = _push(addr)
    frames = [
        messages.encode(
            KEY,
            messages.RankIdentity(JOB, 0, r, world, f"node{r // 12}", 10_000 + r).message(
                "beat", time.time(), phase="train", step=1
            ),
        )
        for r in range(lo, hi)
    ]
    _paced(hi - lo, interval, conn, lambda i, _round: sock.send(frames[i]))
    sock.close()
    ctx.term()


def simulate_nodes(addr: str, lo: int, hi: int, per: int, world: int, interval: float, conn):
    """Relays of nodes [lo, hi), `RelayCore`s fed in-process: each node's ranks beat once per
    interval (step = the round), then its summary is signed and sent."""
    from worker.relay import RelayCore

    ctx, sock = _push(addr)
    cores = []
    for node in range(lo, hi):
        ident = messages.RankIdentity(JOB, 0, node * per, world, f"node{node}", 10_000 + node)
        cores.append(RelayCore(KEY, ident, f"node{node}"))

    def send_one(i: int, rnd: int) -> None:
        core, now = cores[i], time.monotonic()
        first = (lo + i) * per
        beat = {"phase": "train", "step": rnd + 1}
        for r in range(first, first + per):
            core.fold(r, "beat", beat, now)
        sock.send(core.summary_frame(time.time(), now))

    _paced(hi - lo, interval, conn, send_one)
    sock.close()
    ctx.term()


def real_nodes(addr: str, n: int, per: int, world: int, interval: float, conn) -> None:
    """`n` real relays (a ZmqBeacon's thread each, on its own node-local socket), each fed by
    signed beats of its node's other ranks over a real PUSH socket; `silence` stops rank 1."""
    import zmq

    from worker.beat import ZmqBeacon
    from worker.relay import RelayCore, relay_address

    relays, feeds, idents = [], [], []
    ctx = zmq.Context()
    for node in range(n):
        ident = messages.RankIdentity(JOB, 0, node * per, world, f"real{node}", os.getpid())
        local = relay_address(KEY, JOB, 0, f"real{node}")
        beacon = ZmqBeacon(addr, KEY, ident, interval, relay=RelayCore(KEY, ident, f"real{node}"),
                           relay_addr=local)  # fmt: skip
        beacon.phase("train", 1)
        relays.append(beacon)
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(local)
        feeds.append(sock)
        idents += [
            (sock, messages.RankIdentity(JOB, 0, r, world, f"real{node}", 20_000 + r))
            for r in range(node * per + 1, (node + 1) * per)
        ]

    def send_one(i: int, rnd: int) -> None:
        sock, ident = idents[i]
        msg = ident.message("beat", time.time(), phase="train", step=rnd + 1)
        sock.send(messages.encode(KEY, msg))
        if i == 0:
            for b in relays:  # the relays' own ranks move too
                b.phase("train", rnd + 1)

    _paced(len(idents), interval, conn, send_one)
    for sock in feeds:
        sock.close()
    for b in relays:
        b.close()
    ctx.term()


async def measure(world: int, per: int, window: float, hb: HeartbeatConfig, real: int) -> dict:
    relayed = per > 1
    nodes = world // per if relayed else world
    server = HeartbeatServer(KEY, JOB)
    table = AttemptTable(0, world, time.monotonic())
    serve = asyncio.create_task(server.serve(lambda m, now: table.update(m, now)))
    spawn = mp.get_context("spawn")
    sims = []

    def start(target, *args) -> None:
        parent, child = spawn.Pipe()
        p = spawn.Process(target=target, args=(server.address, *args, child))
        p.start()
        sims.append((p, parent))

    if relayed:
        real = max(1, min(real, nodes))
        start(real_nodes, real, per, world, hb.interval_s)  # first: rank 1 is silenced
        for lo in range(real, nodes, NODES_PER_SIMULATOR):
            start(simulate_nodes, lo, min(nodes, lo + NODES_PER_SIMULATOR), per, world,
                  hb.interval_s)  # fmt: skip
        silenced = 1
    else:
        for lo in range(0, world, PER_SIMULATOR):
            start(simulate_ranks, lo, min(world, lo + PER_SIMULATOR), world, hb.interval_s)
        silenced = 0
    findings: list = []
    judge_time = [0.0]

    async def judge() -> None:
        period = judge_period(world, hb.check_s)
        while True:
            await asyncio.sleep(period)
            t0 = time.process_time()
            f = table.judge(time.monotonic(), hb)
            judge_time[0] += time.process_time() - t0
            period = judge_period(table.judged, hb.check_s)
            if f is not None:
                findings.append((time.monotonic(), f))
                if not relayed:  # judged: stop re-reporting these (relayed ones: counted once)
                    for r in f.ranks:
                        table.ranks.pop(r, None)
                        table.direct.pop(r, None)

    judging = asyncio.create_task(judge())
    deadline = time.monotonic() + 60  # warm-up: every rank seen at least once
    while len(table.ranks) < world and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(2 * hb.interval_s)
    findings.clear()
    judge_time[0] = 0.0
    received0, cpu0, t0 = server.received, time.process_time(), time.monotonic()
    await asyncio.sleep(window)
    cpu = time.process_time() - cpu0
    elapsed = time.monotonic() - t0
    rate = (server.received - received0) / elapsed
    judge_frac = judge_time[0] / elapsed
    sims[0][1].send("silence")
    last_beat = sims[0][1].recv()
    detected = None
    deadline = time.monotonic() + hb.timeout_s + 10
    while time.monotonic() < deadline and detected is None:
        await asyncio.sleep(0.02)
        for when, f in findings:
            if f.kind == "hang" and silenced in f.ranks:
                detected = when
    wrong = {r for _, f in findings for r in f.ranks if r != silenced}
    for _p, conn in sims:
        conn.send("stop")
    for p, _ in sims:
        p.join(10)
        if p.is_alive():
            p.kill()
    judging.cancel()
    serve.cancel()
    for task in (judging, serve):
        try:
            await task
        except asyncio.CancelledError:
            pass
    server.close()
    return {
        "ranks": world,
        "nodes": nodes,
        "ranks_per_node": per,
        "relays": relayed,
        "real_relays": real if relayed else 0,
        "msgs_per_s": round(rate),
        "cpu_core_fraction": round(cpu / elapsed, 4),
        "judge_core_fraction": round(judge_frac, 4),
        "hang_found_s": None
        if detected is None
        else round(detected - (last_beat + hb.timeout_s), 3),
        "false_positives": len(wrong),
        "dropped": sum(server.dropped.values()),
        "window_s": window,
        "timeout_s": hb.timeout_s,
        "check_s": hb.check_s,
    }


def row(r: dict) -> str:
    det = "none" if r["hang_found_s"] is None else f"{r['hang_found_s'] * 1000:+.0f} ms"
    mode = f"relay x{r['ranks_per_node']}" if r["relays"] else "direct"
    return (f"{r['ranks']:>7} {mode:>10} {r['nodes']:>7} {r['msgs_per_s']:>8} "
            f"{100 * r['cpu_core_fraction']:>8.1f}% {100 * r['judge_core_fraction']:>7.2f}% "
            f"{det:>10} {r['false_positives']:>6} {r['dropped']:>7}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="100000", help="comma-separated rank counts")
    p.add_argument("--ranks-per-node", type=int, default=1, help="> 1: one relay per node")
    p.add_argument("--no-relay", action="store_true", help="direct beats whatever the node size")
    p.add_argument("--table", action="store_true", help="1k..100k ranks, with and without relays")
    p.add_argument("--real-relays", type=int, default=4, help="relays run for real (the rest: the "
                   "same RelayCore fed in-process)")  # fmt: skip
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--check", type=float, default=0.1)
    args = p.parse_args()
    hb = HeartbeatConfig(interval_s=1.0, timeout_s=args.timeout, check_s=args.check,
                         progress=ProgressConfig(train=600))  # fmt: skip
    per = 1 if args.no_relay else args.ranks_per_node
    runs = [(int(x), per) for x in args.ranks.split(",")]
    if args.table:
        runs = [(w, p) for w in TABLE for p in (1, max(2, args.ranks_per_node))]
    print(f"beats at 1 Hz per rank, timeout_s={hb.timeout_s:g}, check every {hb.check_s:g} s, "
          f"window {args.window:g} s, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'ranks':>7} {'mode':>10} {'nodes':>7} {'msgs/s':>8} {'CPU %core':>9} {'judge %':>8} "
          f"{'hang found':>10} {'false+':>6} {'dropped':>7}")  # fmt: skip
    results = []
    for world, per in runs:
        r = asyncio.run(measure(world, per, args.window, hb, args.real_relays))
        results.append(r)
        print(row(r), flush=True)
    for r in results[:-1]:
        print(json.dumps(r))
    print(json.dumps(results[-1]))


if __name__ == "__main__":
    main()
