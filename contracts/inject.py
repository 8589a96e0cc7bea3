"""The test-only failure points: where a worker rank or the pre-launch node check fails on
purpose when a test asks, all set through one environment variable, `ES_INJECT`.

Its value is the points to arm, comma-separated, each `name=value`:
`ES_INJECT="rank=1,raise_at_step=5"`; a list of names is `+`-separated
(`node_check_fail=n1+n2`). `Injection` declares every point (its name, its value's kind, what
it does); `parse` reads the variable, and refuses an unknown point or a bad value in one line.
The faults a supervisor injects into a running job by its config (`faults/`) are another
matter: these points exist for the tests of what fails inside a rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from contracts.env_names import ENV_INJECT

# Where in an async save a rank can be killed, in the order they happen.
AsyncPhase = Literal["stage", "write", "fanout", "marker", "after-marker"]
ASYNC_PHASES: tuple[AsyncPhase, ...] = ("stage", "write", "fanout", "marker", "after-marker")
LIST_SEPARATOR = "+"
SHOWN_MAX = 40  # the characters of a bad value an error quotes (the variable may be long)


class InjectError(ValueError):
    """An `ES_INJECT` that names an unknown point or gives one a bad value (one line)."""


@dataclass(frozen=True)
class Kind:
    """What a point's value is: said in the docs and errors, read from its text."""

    says: str
    read: Callable[[str], Any]


def _whole(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError
    return value


def _phase(text: str) -> str:
    if text not in ASYNC_PHASES:
        raise ValueError
    return text


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(LIST_SEPARATOR))
    if not all(names) or any(len(name.split()) > 1 for name in names):  # "n1 n2": one of each
        raise ValueError
    return names


RANK = Kind("a rank (an integer >= 0)", _whole)
STEP = Kind("a step (an integer >= 0)", _whole)
SECONDS = Kind("seconds (a number >= 0)", _seconds)
PHASE = Kind(f"an async save's phase ({', '.join(ASYNC_PHASES)})", _phase)
FACTOR = Kind("a factor (a number >= 0)", _seconds)
NODES = Kind(f"node names ({LIST_SEPARATOR}-separated)", _names)


def _point(default: Any, kind: Kind, does: str) -> Any:
    return field(default=default, metadata={"kind": kind, "does": does})


@dataclass(frozen=True)
class Injection:
    """Every failure point, at its value in `ES_INJECT` or unarmed. The worker's points act on
    the rank `rank` only, but for the write delay (a slow file system is everyone's)."""

    rank: int = _point(0, RANK, "the rank the worker's points act on")
    raise_at_step: int | None = _point(None, STEP, "raise an error at the start of this step")
    stall_at_step: int | None = _point(
        None, STEP, "block inside this step for good (the beat thread goes on)"
    )
    kill_in_save_at_step: int | None = _point(
        None, STEP, "SIGKILL the rank in the save of this step, its shards written, no marker"
    )
    kill_async_phase: AsyncPhase | None = _point(
        None, PHASE, "with --async-ckpt: where in the save of kill_in_save_at_step the kill lands"
    )
    ckpt_delay_s: float = _point(
        0.0,
        SECONDS,
        "with --async-ckpt: the background write and fan-out start this long after the stage, "
        "on every rank (training meanwhile changes the state)",
    )
    disk_full_at_step: int | None = _point(
        None, STEP, "the save of this step fails as on a full disk (ENOSPC writing the shard)"
    )
    kill_in_mem_copy_at_step: int | None = _point(
        None, STEP, "SIGKILL the rank in the middle of the memory copy of this step"
    )
    damage_partner_copies_at_step: int | None = _point(
        None,
        STEP,
        "with partner copies: every copy the rank holds for another, from this step on, has a "
        "byte of its data flipped once sealed (damage in the holder's memory)",
    )
    nan_at_step: int | None = _point(
        None, STEP, "a NaN in one of the rank's gradients at this step (the numerical guard's)"
    )
    spike_at_step: int | None = _point(
        None, STEP, "the rank's loss at this step scaled by spike_factor (the numerical guard's)"
    )
    spike_factor: float = _point(100.0, FACTOR, "what spike_at_step scales the loss by")
    write_when_cut_s: float | None = _point(
        None,
        SECONDS,
        "once no lease renewal reached the rank for this long, it writes a complete checkpoint "
        "far ahead (a copy of the newest) every 0.2 s until its lease stops it: a cut-off rank "
        "that keeps saving",
    )
    node_check_fail: tuple[str, ...] = _point(
        (), NODES, "the pre-launch node check fails on these nodes"
    )

    def arms_the_worker(self) -> bool:
        """Whether any point of a worker rank is armed (`rank` alone arms nothing)."""
        worker = (f.name for f in fields(self) if f.name not in ("rank", "node_check_fail"))
        return any(getattr(self, n) != POINTS[n].default for n in worker)


POINTS = {f.name: f for f in fields(Injection)}


def parse(text: str) -> Injection:
    """`ES_INJECT`'s value as the points it arms; InjectError (one line) if it is not valid."""
    values: dict[str, Any] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, equals, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if name not in POINTS:
            known = ", ".join(POINTS)
            raise InjectError(f"{ENV_INJECT}: unknown point {_shown(name)} (known: {known})")
        if not equals:
            raise InjectError(f"{ENV_INJECT}: {name} needs a value ({name}=...)")
        if name in values:
            raise InjectError(f"{ENV_INJECT}: {name} is set twice")
        kind: Kind = POINTS[name].metadata["kind"]
        try:
            values[name] = kind.read(raw)
        except ValueError:
            # A value that holds another point is that point after a wrong separator.
            hint = "; separate points with ','" if any(f"{p}=" in raw for p in POINTS) else ""
            raise InjectError(
                f"{ENV_INJECT}: {name}={_shown(raw)} is not {kind.says}{hint}"
            ) from None
    if "kill_async_phase" in values and "kill_in_save_at_step" not in values:
        raise InjectError(f"{ENV_INJECT}: kill_async_phase needs kill_in_save_at_step")
    return Injection(**values)


def _shown(text: str) -> str:
    """`text` quoted for a one-line error, cut short when long."""
    return repr(text) if len(text) <= SHOWN_MAX else repr(text[:SHOWN_MAX]) + "..."


def read(env: Mapping[str, str]) -> Injection:
    """The points `ES_INJECT` arms in `env` (none when it is unset)."""
    return parse(env.get(ENV_INJECT, ""))


def spec(**points: Any) -> str:
    """The `ES_INJECT` value that arms `points` (a test's way to write one), checked."""
    parts = []
    for name, value in points.items():
        if isinstance(value, (tuple, list)):
            value = LIST_SEPARATOR.join(value)
        parts.append(f"{name}={value}")
    text = ",".join(parts)
    parse(text)
    return text


def describe() -> list[tuple[str, str, str]]:
    """Every point as (name, its value's kind, what it does): for the docs and `--help`."""
    return [(f.name, f.metadata["kind"].says, f.metadata["does"]) for f in fields(Injection)]
