"""`python -m worker.train`: FSDP / HSDP / FSDP+TP training of an agpt model.

Runs under mpiexec, srun, torchrun or the supervisor; saves sharded checkpoints and resumes from
the newest complete one on start; with `ES_STANDBY=1` (the supervisor's warm standby) it prepares
and waits for the word to go (worker.standby). Exit status: 0 finished or stopped gracefully,
2 bad input, 3 the numerical guard gave up (diverged), 1 anything else (after bringing the
whole job down).

No torch at this module's level: a usage error is printed before the slow import of torch,
which `worker.loop` brings in once the flags are known to be good.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

from contracts import env_names
from contracts.template_msgs import STOP_SIGNALS
from worker import hooks as test_hooks
from worker import stack_dump
from worker.args import TrainArgs, parse_args, plan_run
from worker.beat import Beacon
from worker.ckpt import owner
from worker.dist import RankInfo, abort_job, abort_unformed, detect_rank, end_process
from worker.errors import UsageError
from worker.layout import Layout
from worker.metrics import metrics_dir
from worker.presets import ModelConfig

PEER_ERROR_GRACE_S = 5.0  # a rank other than 0 waits this long before reporting a usage error


class StopRequest:
    """SIGTERM / SIGUSR1 ask for a checkpoint at the end of the current step, then exit 0."""

    def __init__(self):
        self.requested = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        # Held blocked by whoever started us (a fork template, its client going cold): a stop
        # that came before these handlers is taken now, not lost nor the end of the rank.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _handle(self, signum, frame):
        self.requested = True


def check_paths(args: TrainArgs) -> None:
    """Fail early, before any rank waits on another, on directories that cannot be written."""
    for label, raw in (("output", str(metrics_dir(args))), ("--ckpt-dir", args.ckpt_dir)):
        if raw is None:
            continue
        path = Path(raw)
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise UsageError(
                f"{label} directory {path} is not writable ({exc.strerror}); choose a writable path"
            ) from None
    if args.ckpt_dir:
        owner.refuse_if_owned(Path(args.ckpt_dir))


def main(argv: list[str] | None = None, stop: StopRequest | None = None) -> int:
    """`stop`: the request a prepared rank (worker.prepared) has watched for since its start."""
    info = detect_rank(os.environ)
    # Early: a stop asked for during start-up is honoured after step one.
    stop = stop if stop is not None else StopRequest()
    # Early too: a rank stuck anywhere from here on can be asked for its stacks (SIGUSR2).
    stack_dump.install(os.environ, info.rank)
    say = print if info.rank == 0 else (lambda *a, **k: None)
    try:  # the same answer on every rank: each says it and ends
        take_umask(os.environ)  # before anything is written
        args = parse_args(argv)
        hooks = test_hooks.from_env(os.environ, info.rank, args.async_ckpt, args.ckpt_dir)
        cfg, layout = plan(args, info)
        standby = standby_requested(os.environ)
    except UsageError as exc:
        say_once(info, exc)
        return exc.exit_code
    try:  # an answer of this rank's host and moment: its peers may go on without it
        check_paths(args)
    except UsageError as exc:
        say_once(info, exc)
        return abort_unformed(info, exc.exit_code)
    beacon = Beacon.from_env(info.rank, info.world, info.local_rank, info.local_world)
    beacon.hello("init")
    try:
        from worker import loop  # torch: slow, so only once the flags are known to be good

        return loop.run(
            args, info, cfg, layout, beacon, say, lambda: stop.requested, standby, hooks
        )
    except UsageError as exc:
        say_once(info, exc)
        beacon.error(str(exc), exc.cause)
        beacon.close()
        abort_job(info, exc.exit_code)
    except BaseException as exc:  # a bug or a broken peer: bring every rank down, never hang
        # One write: the launcher kills every rank at the abort below, and output a rank wrote
        # in pieces could be cut before the launcher read it all (seen: a traceback cut after
        # its first frame, the exception's own line lost).
        what = f"{type(exc).__name__}: {exc}"
        said = "".join(traceback.format_exception(exc)) + f"error (rank {info.rank}): {what}\n"
        with contextlib.suppress(AttributeError, OSError, ValueError):  # stderr closed: unsaid
            sys.stderr.flush()
            os.write(sys.stderr.fileno(), said.encode())
        beacon.error(what)
        beacon.close()
        abort_job(info, 1)
    return 1


def say_once(info: RankInfo, exc: UsageError) -> None:
    """A usage error, said once for the job: most (a bad flag, another model's checkpoint) hit
    every rank at once, so rank 0 says it; another rank first gives rank 0 the time to say it
    and end the job (a peer that exits first would have the launcher kill rank 0 unheard),
    and says it itself only if the job is still there."""
    if info.rank != 0:
        time.sleep(PEER_ERROR_GRACE_S)
        print(f"error (rank {info.rank}): {exc}", file=sys.stderr, flush=True)
    else:
        print(f"error: {exc}", file=sys.stderr, flush=True)


def take_umask(env: Mapping[str, str]) -> None:
    """The supervisor's umask (`ES_UMASK`): what this rank writes (metrics, stacks,
    checkpoints) is no more open to other users than the run dir, on any host."""
    try:
        mask = env_names.umask_of(env)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if mask is not None:
        os.umask(mask)


def plan(args: TrainArgs, info: RankInfo) -> tuple[ModelConfig, Layout]:
    """Checks that need no process group: model sizes, the mesh, the token file."""
    cfg, layout = plan_run(args, info.world)
    if args.data_path is not None and not Path(args.data_path).is_file():
        raise UsageError(
            f"token file {args.data_path} does not exist; pass --data-path to a "
            f"file of {args.data_dtype} token ids"
        )
    return cfg, layout


def standby_requested(env: Mapping[str, str]) -> bool:
    """`ES_STANDBY=1`: start as a warm standby (worker.standby), which only the supervisor's
    control channel can tell to go or exit."""
    if env.get(env_names.ENV_STANDBY, "") != "1":
        return False
    missing = [
        name
        for name in (env_names.ENV_HEARTBEAT_ADDR, env_names.ENV_CONTROL_ADDR)
        if not env.get(name)
    ]
    if missing:
        raise UsageError(
            f"{env_names.ENV_STANDBY}=1 without {' and '.join(missing)}: a standby waits for the "
            "supervisor's go or exit on its control channel; unset it to train at once"
        )
    return True


if __name__ == "__main__":
    end_process(main())
