"""How many ranks one supervisor holds: heartbeats at 1 Hz from simulated ranks.

A few simulator processes each send, for thousands of ranks, one signed `beat` per rank per
second (evenly spread) over a real ZeroMQ PUSH socket to the supervisor's real HeartbeatServer,
which verifies every message, folds it into the real AttemptTable, and runs the real
`judge_ranks` every `check_s`. After a warm-up, the supervisor's own CPU time is measured over a
window (CPU per 1,000 ranks), then one rank is silenced and the time to the `hang` finding is
measured against (its last beat + timeout_s). Any other rank judged lost is a false positive:
the server fell behind.

Usage: python bench/heartbeat_scale.py [--ranks 1000,5000,10000,20000] [--window 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

from supervisor import protocol
from supervisor.config import HeartbeatConfig, ProgressConfig
from supervisor.decisions import judge_period, judge_ranks
from supervisor.heartbeat import AttemptTable, HeartbeatServer

KEY = b"bench-key-" * 4
JOB = "scale"
PER_SIMULATOR = 5000


def simulate(addr: str, lo: int, hi: int, world: int, interval: float, conn) -> None:
    """Beats for ranks [lo, hi), each once per `interval`, spread evenly; silence `lo` on cue."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(addr)
    frames = []
    for r in range(lo, hi):
        ident = protocol.RankIdentity(JOB, 0, r, world, f"node{r // 12}", 10_000 + r)
        frames.append(
            protocol.encode(KEY, ident.message("beat", time.time(), phase="train", step=1))
        )
    n = hi - lo
    start = time.monotonic()
    # Rank i is due at start + (i / n) * interval + k * interval.
    sent_rounds = 0
    next_i = 0
    silenced = False
    last_beat_lo = start
    while True:
        if conn.poll():
            cmd = conn.recv()
            if cmd == "silence":
                silenced = True
                conn.send(last_beat_lo)
            elif cmd == "stop":
                break
        now = time.monotonic()
        due = int((now - start) / interval * n)  # beats due so far, over all rounds
        target = due - sent_rounds * n
        while next_i < min(target, n):
            if not (silenced and next_i == 0):
                sock.send(frames[next_i])
                if next_i == 0:
                    last_beat_lo = time.monotonic()
            next_i += 1
        if next_i >= n:
            next_i = 0
            sent_rounds += 1
            continue
        time.sleep(0.005)
    sock.close()
    ctx.term()


async def measure(world: int, window: float, hb: HeartbeatConfig) -> dict:
    server = HeartbeatServer(KEY, JOB)
    table = AttemptTable(0, world, time.monotonic())
    serve = asyncio.create_task(server.serve(lambda m, now: table.update(m, now)))
    spawn = mp.get_context("spawn")
    sims = []
    for lo in range(0, world, PER_SIMULATOR):
        hi = min(world, lo + PER_SIMULATOR)
        parent, child = spawn.Pipe()
        p = spawn.Process(
            target=simulate, args=(server.address, lo, hi, world, hb.interval_s, child)
        )
        p.start()
        sims.append((p, parent, lo))
    findings: list = []
    judge_time = [0.0]

    async def judge() -> None:
        period = judge_period(world, hb.check_s)
        while True:
            await asyncio.sleep(period)
            t0 = time.process_time()
            f = judge_ranks(table.ranks, world, time.monotonic(), table.launched_at, hb)
            judge_time[0] += time.process_time() - t0
            if f is not None:
                findings.append((time.monotonic(), f))
                table.ranks.pop(f.ranks[0], None)  # judged: stop re-reporting this one
                for r in f.ranks[1:]:
                    table.ranks.pop(r, None)

    judging = asyncio.create_task(judge())
    # Warm-up: every rank seen at least once.
    deadline = time.monotonic() + 30
    while len(table.ranks) < world and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(2 * hb.interval_s)
    findings.clear()
    judge_time[0] = 0.0
    received0, cpu0, t0 = server.received, time.process_time(), time.monotonic()
    main0 = time.thread_time()
    await asyncio.sleep(window)
    cpu = time.process_time() - cpu0
    main_cpu = time.thread_time() - main0
    elapsed = time.monotonic() - t0
    rate = (server.received - received0) / elapsed
    false_before = len(findings)
    # Detection: silence rank 0 (in simulator 0) and wait for the hang finding.
    sims[0][1].send("silence")
    last_beat = sims[0][1].recv()
    detected = None
    deadline = time.monotonic() + hb.timeout_s + 10
    while time.monotonic() < deadline and detected is None:
        await asyncio.sleep(0.02)
        for when, f in findings:
            if f.kind == "hang" and 0 in f.ranks:
                detected = when
    others = sum(len([r for r in f.ranks if r != 0]) for _, f in findings) + false_before
    for _p, conn, _ in sims:
        conn.send("stop")
    for p, _, _ in sims:
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
        "world": world,
        "rate": rate,
        "cpu_frac": cpu / elapsed,
        "main_frac": main_cpu / elapsed,
        "judge_frac": judge_time[0] / elapsed,
        "detect_s": None if detected is None else detected - (last_beat + hb.timeout_s),
        "false_positives": others,
        "dropped": sum(server.dropped.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1000,5000,10000,20000")
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--check", type=float, default=0.1)
    args = p.parse_args()
    hb = HeartbeatConfig(interval_s=1.0, timeout_s=args.timeout, check_s=args.check,
                         progress=ProgressConfig(train=600))  # fmt: skip
    print(f"beats at 1 Hz per rank, timeout_s={hb.timeout_s:g}, check every {hb.check_s:g} s, "
          f"{PER_SIMULATOR} ranks per simulator process, window {args.window:g} s")  # fmt: skip
    print(f"{'ranks':>7} {'msgs/s':>8} {'CPU %core':>9} {'per 1k':>7} {'loop %':>6} {'judge %':>7} "
          f"{'detect-timeout':>14} {'false+':>6} {'dropped':>7}")  # fmt: skip
    for world in (int(x) for x in args.ranks.split(",")):
        r = asyncio.run(measure(world, args.window, hb))
        det = "none" if r["detect_s"] is None else f"{r['detect_s'] * 1000:+.0f} ms"
        per_k = 100 * r["cpu_frac"] / (world / 1000)
        print(f"{world:>7} {r['rate']:>8.0f} {100 * r['cpu_frac']:>8.1f}% {per_k:>6.2f}% "
              f"{100 * r['main_frac']:>5.1f}% "
              f"{100 * r['judge_frac']:>6.1f}% {det:>14} {r['false_positives']:>6} "
              f"{r['dropped']:>7}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
