"""The worker's face to the supervisor: the flags `python -m worker.train` takes, checked without
torch, and what they become on fewer ranks.

The supervisor loads this module by name (`supervisor/settings/worker_spec.py`: the `spec` module
of the configured `worker.module`'s package) and uses only the names below, so this module and
everything it imports stay torch-free: `validate` costs milliseconds.

The contract, for any worker package that wants its flags checked and planned:

- `MODULES`: the `python -m` modules whose flags this spec describes.
- `STANDBY_MODULES` (optional): those of `MODULES` that honour the warm standby's protocol:
  started with `ES_STANDBY=1`, a rank prepares, says phase `standby` and waits for `go` or `exit`
  on the control channel. The supervisor keeps a standby (and prepared ranks) only for a module
  named here: one that ignored `ES_STANDBY` would train beside the job as a second one.
- `flag_kinds()`: every flag by its `[worker]` key (the argparse dest), True for a switch.
- `flag_defaults()` (optional): every flag's default by its `[worker]` key: what a key left
  out means (the supervisor reads the checkpoint intervals and their prior from it).
- `flags_problem(argv)`: why the worker refuses these flags, or None.
- `run_problem(argv, world)`: the same, and of the model's sizes and mesh on `world` ranks.
- `plan_shrink(argv, world, new_world)`: a plan with `new_world`, `flags` (the `[worker]` keys
  to override), `problem` (None, or why the smaller world cannot run) and `event()` (the
  `shrink` event's fields, JSON-ready).

A refusal comes back as the worker's own one-line message (a string), never as an exception, so
the supervisor needs none of the worker's types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker import args as worker_args
from worker.errors import UsageError
from worker.shrink_plan import ShrinkPlan, plan_shrink

MODULES = ("worker.train",)
STANDBY_MODULES = ("worker.train",)  # worker.standby: ES_STANDBY=1 prepares and waits for `go`

__all__ = [
    "MODULES",
    "STANDBY_MODULES",
    "ShrinkPlan",
    "flag_defaults",
    "flag_kinds",
    "flags_problem",
    "plan_shrink",
    "run_problem",
]


def flag_kinds() -> dict[str, bool]:
    """Every `--flag` by its dest, True where it is a switch (takes no value): what a config's
    `[worker]` keys are checked against."""
    parser = worker_args.build_parser()
    return {
        action.dest: action.nargs == 0
        for action in parser._actions  # argparse keeps no public list of its options
        if action.option_strings and action.dest != "help"
    }


def flag_defaults() -> dict[str, Any]:
    """Every `--flag`'s default by its dest (`mem_ckpt_interval`: "auto")."""
    parser = worker_args.build_parser()
    return {
        action.dest: action.default
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


def flags_problem(argv: Sequence[str]) -> str | None:
    """The worker's refusal of `argv` (its parser and the checks no layout can make right)."""
    try:
        worker_args.parse_args(list(argv))
    except UsageError as exc:
        return worker_args.refusal(exc)
    return None


def run_problem(argv: Sequence[str], world: int) -> str | None:
    """The worker's refusal of `argv` on `world` ranks: the flags, the model's sizes, the mesh."""
    try:
        worker_args.plan_run(worker_args.parse_args(list(argv)), world)
    except UsageError as exc:
        return worker_args.refusal(exc)
    return None
