"""`[worker]` checked against the worker's own spec before anything launches.

A typo (`save_intervl`), an unknown preset or a negative interval would otherwise surface only
after every rank had started, imported torch and failed. The spec (`worker_spec`) is torch-free,
so this costs the supervisor milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.settings import worker_spec
from supervisor.settings.checks import check_worker_keys, spec_of, worker_error
from supervisor.settings.config import DEFAULT_MODULE, Config


def check(cfg: Config, world: int) -> str | None:
    """Raise ConfigError naming the key and the fix; return a note when the worker module has no
    spec, so that its flags can only be checked for their shape."""
    spec = spec_of(cfg)
    if spec is None:
        return (
            f"worker.module {cfg.worker.module!r} is not {DEFAULT_MODULE}: its flags are passed "
            "as given (checked for their shape only)"
        )
    check_worker_keys(cfg)  # done by loading.from_dict too; a Config built by hand is checked here
    refusal = spec.run_problem(cfg.worker_flags(), world)
    if refusal is not None:
        raise worker_error(cfg, refusal)
    return None


def with_defaults(cfg: Config) -> dict[str, Any]:
    """`[worker]` with every key left out at the worker's own default (its spec's; a worker
    without a spec: the keys given)."""
    return {**worker_spec.flag_defaults(spec_of(cfg)), **cfg.worker.flags}


def ckpt_root(cfg: Config) -> Path | None:
    """The job's checkpoint dir as the supervisor reaches it (`[worker] ckpt_dir`, resolved:
    relative to `[launch] cwd`, where the ranks run); None without one."""
    ckpt = cfg.worker.flags.get("ckpt_dir")
    if not isinstance(ckpt, str) or not ckpt:
        return None
    return Path(cfg.launch.cwd or ".", ckpt).absolute()
