"""`[worker]` checked against the worker's own parser before anything launches.

A typo (`save_intervl`), an unknown preset or a negative interval would otherwise surface only
after every rank had started, imported torch and failed. `worker.args` and what it imports are
torch-free, so this costs the supervisor milliseconds.
"""

from __future__ import annotations

import difflib
import re

from supervisor.config import Config, ConfigError

DEFAULT_MODULE = "worker.train"


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

    kinds = worker_args.flag_kinds(worker_args.build_parser())
    for key, value in cfg.worker.flags.items():
        _check_key(cfg.source, key, value, kinds)
    try:
        args = worker_args.parse_args(cfg.worker_flags())
        worker_args.plan_run(args, world)
    except UsageError as exc:
        message = str(exc).removeprefix("python -m worker.train: ").removesuffix(" (see --help)")
        where = _key_named(message, cfg.worker.flags)
        raise ConfigError(cfg.source, where, f"{message} (the worker's own check)") from None
    return None


def _check_key(source: str, key: str, value: object, kinds: dict[str, bool]) -> None:
    where, flag = f"worker.{key}", "--" + key.replace("_", "-")
    if key not in kinds:
        close = difflib.get_close_matches(key, list(kinds), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]} ({_flag(close[0])})?" if close else ""
        raise ConfigError(
            source, where, f"the worker has no flag {flag}{hint} (python -m worker.train --help)"
        )
    if kinds[key] and not isinstance(value, bool):
        raise ConfigError(source, where, f"{flag} is a switch: expected true or false")
    if not kinds[key] and isinstance(value, bool):
        raise ConfigError(source, where, f"{flag} takes a value, not {str(value).lower()}")


def _key_named(message: str, flags: dict[str, object]) -> str:
    """`worker.<key>` for the first of the table's flags that the worker's message names."""
    named = [(message.find(_flag(k)), k) for k in flags if re.search(_flag(k) + r"\b", message)]
    return f"worker.{min(named)[1]}" if named else "worker"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
