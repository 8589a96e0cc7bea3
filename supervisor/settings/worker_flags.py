"""`[worker]` checked against the worker's own parser before anything launches.

A typo (`save_intervl`), an unknown preset or a negative interval would otherwise surface only
after every rank had started, imported torch and failed. `worker.args` and what it imports are
torch-free, so this costs the supervisor milliseconds.
"""

from __future__ import annotations

from supervisor.settings.config import DEFAULT_MODULE, Config, check_worker_keys, worker_error


def check(cfg: Config, world: int) -> str | None:
    """Raise ConfigError naming the key and the fix; return a note when the worker is a custom
    module whose flags can only be checked for their shape."""
    if cfg.worker.module != DEFAULT_MODULE:
        return (
            f"worker.module {cfg.worker.module!r} is not {DEFAULT_MODULE}: its flags are passed "
            "as given (checked for their shape only)"
        )
    from worker import args as worker_args
    from worker.errors import UsageError

    check_worker_keys(cfg)  # done by config.from_dict too; a Config built by hand is checked here
    try:
        worker_args.plan_run(worker_args.parse_args(cfg.worker_flags()), world)
    except UsageError as exc:
        raise worker_error(cfg, exc) from None
    return None
