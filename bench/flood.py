"""The supervisor's memory under a heartbeat flood, and whether it still finds a hang.

Runs the real supervisor (`python -m supervisor run`) on 2 light ranks (the real Beacon, no
torch) that beat and step until told to stop. Once they train, `--connections` PUSH sockets send
junk frames (`--frame-kib`, unsigned, wrongly signed and malformed in turn) at its heartbeat
port as fast as they can for `--seconds`; the supervisor's RSS is sampled every 0.25 s before,
during and after. Then rank 1 stops itself (SIGSTOP) and the time to the `hang` finding is read
from the events. Prints idle / peak / after RSS and their ratios, the `bad_messages` events
written and the hang's latency, and as its last line one JSON object.

Usage: python bench/flood.py [--seconds 30] [--connections 4] [--frame-kib 16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import zmq

REPO = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    from worker.beat import Beacon

    rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK"))
    world = int(os.environ.get("WORLD_SIZE") or os.environ.get("PMI_SIZE"))
    stop_file = os.path.join(os.environ["ES_ATTEMPT_DIR"], "stop-rank1")
    b = Beacon.from_env(rank, world)
    b.hello("init")
    b.phase("train", 0)
    for step in range(1, 1_000_000):
        time.sleep(0.1)
        b.step(step, 1.0, 0.1)
        if rank == 1 and os.path.exists(stop_file):
            os.kill(os.getpid(), signal.SIGSTOP)
    """
)


def flood(address: str, seconds: float, frame_kib: int, seed: int, counter) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    size = frame_kib * 1024
    frames = [
        os.urandom(size),  # junk
        b"0" * 64 + b"{" + b" " * (size - 66) + b"}",  # a wrong signature
        b"x" * 10,  # too short to be signed
    ]
    sent, i = 0, seed
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            sock.send(frames[i % len(frames)], zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            time.sleep(0.0005)
        i += 1
    with counter.get_lock():
        counter.value += sent
    sock.close(linger=0)
    ctx.term()


def wait_for(path: Path, pred, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if pred(e):
                    return e
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting in {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--frame-kib", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="es-flood-") as tmp:
        work = Path(tmp)
        (work / "bench_rank.py").write_text(RANK)
        run = work / "run"
        config = work / "flood.toml"
        config.write_text(textwrap.dedent(f"""
            [job]
            name = "flood"
            run_dir = "{run}"
            [launch]
            launcher = "local"
            ranks_per_node = 2
            cwd = "{work}"
            env = {{ PYTHONPATH = "{REPO}" }}
            [worker]
            module = "bench_rank"
            [restart]
            max_restarts = 0
            teardown_grace_s = 0.5
            [heartbeat]
            interval_s = 0.5
            timeout_s = 2.0
            [heartbeat.progress]
            train = 30
            """))  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        sup = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "run", str(config), "--quiet", "--no-report"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proc = psutil.Process(sup.pid)
        events = run / "events.jsonl"
        try:
            start = wait_for(events, lambda e: e.get("event") == "start", 30)
            wait_for(events, lambda e: e.get("event") == "first_step", 30)
            address = start["heartbeat"]

            def sample(seconds: float) -> list[float]:
                out, end = [], time.monotonic() + seconds
                while time.monotonic() < end:
                    out.append(proc.memory_info().rss / 2**20)
                    time.sleep(0.25)
                return out

            idle = sample(3.0)
            counter = mp.Value("q", 0)
            floods = [
                mp.Process(target=flood, args=(address, args.seconds, args.frame_kib, i, counter))
                for i in range(args.connections)
            ]
            for f in floods:
                f.start()
            during = sample(args.seconds)
            for f in floods:
                f.join(timeout=10)
            after = sample(5.0)
            (run / "attempts" / "000" / "stop-rank1").write_text("")
            stopped = time.monotonic()
            hang = wait_for(events, lambda e: e.get("event") == "hang", 30)
        finally:
            sup.send_signal(signal.SIGTERM)
            try:
                sup.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sup.kill()
        evs = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
        bad = [e for e in evs if e.get("event") == "bad_messages"]
        idle_mb = sorted(idle)[len(idle) // 2]
        result = {
            "connections": args.connections,
            "frame_kib": args.frame_kib,
            "seconds": args.seconds,
            "frames_sent": counter.value,
            "idle_rss_mb": round(idle_mb, 1),
            "peak_rss_mb": round(max(during), 1),
            "after_rss_mb": round(after[-1], 1),
            "peak_ratio": round(max(during) / idle_mb, 2),
            "after_ratio": round(after[-1] / idle_mb, 2),
            "bad_messages_events": len(bad),
            "dropped": bad[-1]["by_reason"] if bad else {},
            "hang_latency_s": hang.get("latency_s"),
            "stop_to_hang_s": round(hang["mono"] - stopped, 2) if "mono" in hang else None,
        }
        print(f"supervisor RSS: idle {idle_mb:.0f} MiB, peak {max(during):.0f} MiB "
              f"({result['peak_ratio']}x), after {after[-1]:.0f} MiB ({result['after_ratio']}x); "
              f"{counter.value} junk frames of {args.frame_kib} KiB from {args.connections} "
              f"connections in {args.seconds:.0f} s; {len(bad)} bad_messages events; "
              f"hang found {result['stop_to_hang_s']} s after the SIGSTOP")  # fmt: skip
        print(json.dumps(result))


if __name__ == "__main__":
    main()
