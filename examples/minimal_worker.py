"""A training script of your own under the supervisor: the least its protocol asks
(docs/worker-protocol.md), with no torch, so that every part of the contract is in sight.

Each rank "trains" one number toward 1.0, a step at a time, and keeps it in a checkpoint of its
own (`--ckpt-dir`, which the supervisor passes as `RUN_DIR/ckpt`). The ranks of this toy never
talk to each other; a real script's agree on the checkpoint through their process group.

    python -m supervisor run examples/minimal.toml      # from the repository root

Run alone (`python -m examples.minimal_worker --ckpt-dir /tmp/ck`) it trains as rank 0 of 1 and
tells no one: the client does nothing without `ES_HEARTBEAT_ADDR`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from worker.beat import Beacon  # the torch-free client: every call returns at once
from worker.dist import detect_rank  # rank and world from any launcher's variables
from worker.stack_dump import install as install_stack_dump  # SIGUSR2: stacks on a hang

USAGE_EXIT = 2  # bad input: the supervisor ends the job instead of relaunching


class BadInput(Exception):
    """A flag or input this script refuses: one line, and exit 2."""


class Args(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage and line
        raise BadInput(f"{self.prog}: error: {message}")


def parse(argv: list[str]) -> argparse.Namespace:
    p = Args(prog="minimal_worker")
    p.add_argument("--train-iters", type=int, default=60)  # [worker] train_iters
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.02)  # what one step takes
    p.add_argument("--ckpt-dir", default="")
    args = p.parse_args(argv)
    if args.train_iters < 1 or args.save_interval < 1 or args.step_s < 0:
        p.error("--train-iters and --save-interval must be >= 1, --step-s >= 0")
    return args


def load(path: Path) -> tuple[int, float]:
    """The step and value of the last save; (0, 0.0) to start fresh."""
    if not path.is_file():
        return 0, 0.0
    state = json.loads(path.read_text())
    return state["step"], state["w"]


def save(path: Path, step: int, w: float) -> None:
    """Atomically: a rank killed while it writes leaves the previous save whole."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "w": w}))
    os.replace(tmp, path)


def main() -> int:
    started = time.monotonic()
    me = detect_rank(os.environ)
    beacon = Beacon.from_env(me.rank, me.world, me.local_rank, me.local_world)
    beacon.hello("init")  # first, within [heartbeat.progress] init of the launch
    install_stack_dump(os.environ, me.rank)
    stop = []  # the launcher's stop signal: SIGTERM (local, PALS) or SIGUSR1 (Hydra, srun)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        args = parse(sys.argv[1:])
    except BadInput as exc:  # one line, said to the supervisor too, and exit 2
        beacon.error(str(exc))
        beacon.close()
        print(exc, file=sys.stderr)
        return USAGE_EXIT
    path = Path(args.ckpt_dir or ".") / f"rank-{me.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    beacon.phase("load", 0)
    step, w = load(path)
    beacon.phase("train", step)
    resumed = step > 0
    while step < args.train_iters:
        t = time.monotonic()
        time.sleep(args.step_s)  # the step's work
        w += 0.1 * (1.0 - w)
        step += 1
        if resumed:  # the first step after a resume: how long the restart took
            beacon.resumed(step - 1, time.monotonic() - started)
            resumed = False
        beacon.step(step, loss=(1.0 - w) ** 2, dt=time.monotonic() - t)
        if step % args.save_interval == 0 or stop or step == args.train_iters:
            beacon.phase("save", step)
            save(path, step, w)
            if me.rank == 0:
                beacon.ckpt(step, "complete")
            beacon.phase("train", step)
        if stop:  # saved: exit 0 without `done`, which would make the stop a finish
            beacon.close()
            return 0
    beacon.done(step)  # every rank, before it exits 0: an exit 0 without it is a failure
    beacon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
