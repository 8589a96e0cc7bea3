"""`[[faults]]` tables as typed specs: one trigger, one action, one target each.

Parsing is strict like the rest of the config: unknown keys, wrong types, and faults that could
never fire (a step at or past `train_iters`, a rank outside the world, a marker gate with no
checkpoint to wait for) raise `ConfigError` naming the file and `faults[i].key`.

Parsed once, when the config is loaded (`parse_all`); `check_world` checks the targets again once
the job's nodes are resolved. The engine takes the specs as they are.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from contracts.config_table import ConfigError, Table, is_int

ACTIONS = (
    "kill", "term", "hang", "stall", "slow", "corrupt", "unmark", "node_loss", "nan", "spike",
    "partition",
)  # fmt: skip
TIME_KEYS = ("at_s", "every_s", "mtbf_s")
STEP_KEYS = ("at_step", "every_steps")
# Actions that end the attempt: after one fires, other faults wait for the next attempt.
DISRUPTIVE = frozenset(
    {"kill", "term", "hang", "stall", "corrupt", "unmark", "node_loss", "partition"}
)
# Actions the rank must carry out inside its own step: always through the control channel.
IN_STEP = frozenset({"stall", "slow", "nan", "spike"})
# The numerical guard's faults (worker.guard_step): a bad step the ranks must catch, not a kill.
NUMERIC = frozenset({"nan", "spike"})
KNOWN_KEYS = (
    "name",
    "at_s",
    "every_s",
    "jitter_s",
    "count",
    "mtbf_s",
    "seed",
    "at_step",
    "every_steps",
    "during",
    "after_checkpoint",
    "action",
    "signal",
    "delay_s",
    "duration_s",
    "factor",
    "mode",
    "target",
    "via",
)


@dataclass(frozen=True)
class Trigger:
    """When: `kind` is the one trigger key given; the others keep their defaults."""

    kind: Literal["at_s", "every_s", "mtbf_s", "at_step", "every_steps", "during"]
    at_s: tuple[float, ...] = ()
    every_s: float = 0.0
    jitter_s: float = 0.0
    mtbf_s: float = 0.0
    # every_s / mtbf_s / during: how many times at most (None: no limit; `during`: 1).
    count: int | None = None
    seed: int = 0
    at_step: tuple[int, ...] = ()
    every_steps: int = 0
    during: Literal["", "save"] = ""
    after_checkpoint: bool = False

    @property
    def timed(self) -> bool:
        return self.kind in TIME_KEYS


@dataclass(frozen=True)
class Action:
    """What: `signal` for kill (SIGKILL by default); `delay_s`/`duration_s` for slow;
    `mode` (truncate | flip) for corrupt; node_loss SIGKILLs a node's ranks, takes its memory
    root away, and leaves it down; partition cuts a node's network link for `duration_s` (0:
    until the job ends), its processes left running (the test bed's `cut`); nan poisons a
    gradient of the target ranks, spike scales their loss by `factor` (the numerical guard's to
    catch)."""

    kind: Literal[
        "kill",
        "term",
        "hang",
        "stall",
        "slow",
        "corrupt",
        "unmark",
        "node_loss",
        "nan",
        "spike",
        "partition",
    ]
    signal: int = signal.SIGKILL
    delay_s: float = 0.0
    duration_s: float = 0.0
    factor: float = 1.0
    mode: Literal["truncate", "flip"] = "truncate"

    @property
    def signum(self) -> int:
        """The signal this action sends to the target ranks (kill after corrupt/unmark)."""
        return {"term": signal.SIGTERM, "hang": signal.SIGSTOP}.get(self.kind, self.signal)


@dataclass(frozen=True)
class Target:
    """Whom: every rank, one rank, every rank of one node or of neighbouring nodes
    (`node:A-B`: nodes A to B), or one seeded random rank."""

    kind: Literal["all", "rank", "node", "random"] = "all"
    index: int = 0
    last: int | None = None  # node:A-B: the last node of the range

    @property
    def nodes(self) -> range:
        """The node indices a node target names."""
        return range(self.index, (self.last if self.last is not None else self.index) + 1)

    def __str__(self) -> str:
        if self.kind == "node" and self.last is not None:
            return f"node:{self.index}-{self.last}"
        return f"{self.kind}:{self.index}" if self.kind in ("rank", "node") else self.kind


@dataclass(frozen=True)
class FaultSpec:
    index: int
    name: str
    trigger: Trigger
    action: Action
    target: Target
    # auto: a signal by pid on this host, the control channel elsewhere; control: always it.
    via: Literal["auto", "control"] = "auto"
    # The [[faults]] table as given: the resolved config.toml and --dry-run show it unchanged.
    table: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def label(self) -> str:
        return self.name or f"faults[{self.index}]"


@dataclass(frozen=True)
class JobShape:
    """What validation needs to know of the job; None where it is not known yet."""

    train_iters: int | None = None
    save_interval: int | None = None
    save_on_exit: bool = True
    ckpt_verify: str = "size"
    world: int | None = None
    nodes: int | None = None
    ranks_per_node: int = 1
    guard: str = "skip"  # the numerical guard's action ([guard] action, or [worker] guard)


def shape_of(cfg: Any, world_nodes: int | None = None) -> JobShape:
    """The JobShape of a supervisor Config (worker flags, launch) and, once resolved, the nodes
    it starts on (its spares are not part of the world)."""
    flags = cfg.worker.flags
    nodes = world_nodes
    if nodes is None and isinstance(cfg.launch.nodes, list):
        nodes = len(cfg.launch.nodes) - cfg.launch.spares
    ranks_per_node = cfg.launch.ranks_per_node
    ti, si = flags.get("train_iters"), flags.get("save_interval")
    return JobShape(
        train_iters=ti if is_int(ti) else None,
        save_interval=si if is_int(si) else (0 if si is None else None),
        save_on_exit=flags.get("save_on_exit", True) is not False,
        ckpt_verify=str(flags.get("ckpt_verify", "size")),
        world=nodes * ranks_per_node if nodes else None,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        guard=str(flags.get("guard", getattr(getattr(cfg, "guard", None), "action", "skip"))),
    )


def parse_all(raw: Any, source: str, shape: JobShape | None = None) -> list[FaultSpec]:
    """Every [[faults]] table, checked against the job's shape."""
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(source, "faults", "expected [[faults]] tables")
    return [parse(t, i, source, shape or JobShape()) for i, t in enumerate(raw)]


def check_world(specs: Sequence[FaultSpec], source: str, shape: JobShape) -> None:
    """Once the job's nodes are resolved: every targeted rank and node exists."""
    for spec in specs:
        _check_target(spec.target, shape, Table(dict(spec.table), f"faults[{spec.index}]", source))


def parse(table: dict[str, Any], index: int, source: str, shape: JobShape) -> FaultSpec:
    p = Table(table, f"faults[{index}]", source)
    p.reject_unknown(KNOWN_KEYS)
    trigger = _trigger(p, shape)
    action = _action(p, shape)
    target = _target(p, shape)
    if action.kind == "partition" and target.kind not in ("node", "rank"):
        p.fail("target", f'partition cuts a node off: expected "node:N", "node:A-B" or "rank:R" '
               f"(its node), got {str(target)!r}")  # fmt: skip
    if action.kind == "node_loss" and target.kind != "node":
        p.fail(
            "target",
            f'node_loss takes nodes away: expected "node:N" or "node:A-B", got {str(target)!r}',
        )
    if action.kind in NUMERIC and (trigger.kind == "during" or trigger.after_checkpoint):
        gate = "during" if trigger.kind == "during" else "after_checkpoint"
        p.fail(gate, f"{action.kind} acts at its very step, and a save or a checkpoint comes "
               "only after that step: give at_step or every_steps alone")  # fmt: skip
    via = p.choice("via", ("auto", "control"), "auto")
    name = p.string("name", "")
    if action.kind == "term" and "signal" in table:
        p.fail("signal", 'term always sends SIGTERM; use action = "kill" with a signal')
    return FaultSpec(index, name, trigger, action, target, via, dict(table))


def _trigger(p: Table, shape: JobShape) -> Trigger:
    given = [k for k in (*TIME_KEYS, *STEP_KEYS, "during") if k in p.raw]
    main = [k for k in given if k != "during"]
    if "during" in given and any(k in TIME_KEYS for k in main):
        p.fail("during", "combines with at_step (the save at or after it) or stands alone")
    if len(main) > 1:
        p.fail(main[1], f"one trigger per fault: {main[0]} is already given")
    if not given:
        p.fail("", "expected a trigger: at_s, every_s, mtbf_s, at_step, every_steps or during")
    kind = "during" if "during" in given else main[0]
    if "every_steps" in main and "during" in given:
        p.fail("during", "combines with at_step, not every_steps")
    fields: dict[str, Any] = {"kind": kind}
    allowed: set[str] = set()
    if kind == "at_s":
        fields["at_s"] = tuple(sorted(p.numbers("at_s", minimum=0.0)))
    elif kind in ("every_s", "mtbf_s"):
        fields[kind] = p.number(kind, positive=True)
        fields["count"] = p.count()
        allowed = {"count"}
        if kind == "every_s":
            jitter = p.number("jitter_s", default=0.0)
            if not 0 <= jitter < fields["every_s"]:
                p.fail("jitter_s", f"expected 0 <= jitter_s < every_s ({fields['every_s']:g})")
            fields["jitter_s"] = jitter
            allowed.add("jitter_s")
    else:
        if "at_step" in p.raw:
            steps = p.integers("at_step", minimum=1)
            fields["at_step"] = tuple(sorted(set(steps)))
        if kind == "every_steps":
            fields["every_steps"] = p.integer("every_steps", None, minimum=1)
        if kind == "during":
            fields["during"] = p.choice("during", ("save",), "save")
            if "at_step" in p.raw and "count" in p.raw:
                p.fail("count", "with at_step, each step is one trigger point")
            fields["count"] = None if "at_step" in p.raw else (p.count() or 1)
            allowed.add("count")
            if not shape.save_interval and shape.save_interval is not None:
                p.fail("during", "there are no saves: set worker.save_interval")
        fields["after_checkpoint"] = p.boolean("after_checkpoint", False)
        allowed.add("after_checkpoint")
        _check_steps(p, shape, fields)
    # The fault's seed: jitter, exponential intervals, and a random target.
    fields["seed"] = p.integer("seed", 0)
    for key in ("jitter_s", "count", "after_checkpoint"):
        if key in p.raw and key not in allowed:
            p.fail(key, f"does not apply to a {kind} trigger")
    return Trigger(**fields)


def _check_steps(p: Table, shape: JobShape, fields: dict[str, Any]) -> None:
    """Steps the job reaches, and for a marker gate a periodic save at or past each."""
    last, si = shape.train_iters, shape.save_interval
    key = "at_step" if fields.get("at_step") else "every_steps"
    points = list(fields.get("at_step", ()))
    if fields["kind"] == "every_steps" and last is not None:
        points = list(range(fields["every_steps"], last, fields["every_steps"]))
        if not points:
            p.fail(key, f"no multiple of {fields['every_steps']} below worker.train_iters ({last})")
    if last is not None:
        for s in points:
            if s >= last:
                p.fail(key, f"step {s} is never reached before the end (worker.train_iters = "
                       f"{last}); expected steps below it")  # fmt: skip
    gated = fields.get("after_checkpoint") or fields["kind"] == "during"
    if not gated:
        return
    what = "after_checkpoint" if fields.get("after_checkpoint") else "during"
    if si == 0:
        p.fail(what, "there are no checkpoints: set worker.save_interval")
    if si is None or last is None:
        return
    for s in points:
        save = -(-s // si) * si
        if save >= last:
            p.fail(what, f"no checkpoint at or after step {s} before the end (save_interval "
                   f"{si}, train_iters {last})")  # fmt: skip


def _action(p: Table, shape: JobShape) -> Action:
    kind = p.choice("action", ACTIONS, None)
    fields: dict[str, Any] = {"kind": kind}
    allowed = set()
    if kind in ("kill", "corrupt", "unmark"):
        if "signal" in p.raw:
            fields["signal"] = _signal(p)
        allowed.add("signal")
    if kind == "slow":
        fields["delay_s"] = p.number("delay_s", positive=True)
        fields["duration_s"] = p.number("duration_s", positive=True)
        allowed |= {"delay_s", "duration_s"}
    if kind == "partition":
        fields["duration_s"] = p.number("duration_s", 0.0)
        if fields["duration_s"] < 0:
            p.fail("duration_s", "expected seconds >= 0 (0: cut until the job ends)")
        allowed.add("duration_s")
    if kind == "spike":
        fields["factor"] = p.number("factor", 100.0, positive=True)
        if fields["factor"] <= 1:
            p.fail(
                "factor", f"a spike scales the loss up: expected above 1, got {fields['factor']}"
            )
        allowed.add("factor")
    if kind in NUMERIC and shape.guard == "off":
        p.fail("action", f'{kind} is for the numerical guard to catch: it is off (guard.action = '
               '"off"); set guard.action to "skip" or "rollback"')  # fmt: skip
    if kind == "corrupt":
        fields["mode"] = p.choice("mode", ("truncate", "flip"), "truncate")
        allowed.add("mode")
        if fields["mode"] == "flip" and shape.ckpt_verify != "crc":
            p.fail("mode", 'flipped bytes keep the size: set worker.ckpt_verify = "crc" so that '
                   'resume detects them, or use mode = "truncate"')  # fmt: skip
    if kind in ("corrupt", "unmark") and shape.save_interval == 0:
        p.fail("action", f"{kind} needs checkpoints: set worker.save_interval")
    for key in ("signal", "delay_s", "duration_s", "factor", "mode"):
        if key in p.raw and key not in allowed and not (key == "signal" and kind == "term"):
            p.fail(key, f"does not apply to action {kind!r}")
    if kind in IN_STEP and p.raw.get("via", "auto") not in ("auto", "control"):
        p.fail("via", f"{kind} is carried out by the rank itself: via the control channel")
    return Action(**fields)


def _signal(p: Table) -> int:
    value = p.raw["signal"]
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return int(signal.Signals(value))
        except ValueError:
            p.fail("signal", f"no signal number {value}")
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in signal.Signals.__members__:
            return int(signal.Signals[name])
    p.fail("signal", f'expected a signal name like "SIGKILL" or a number, got {value!r}')
    raise AssertionError  # unreachable


def _target(p: Table, shape: JobShape) -> Target:
    text = p.string("target", "all")
    kind, _, num = text.partition(":")
    if kind in ("all", "random") and not num:
        return Target(kind)  # type: ignore[arg-type]
    first, dash, last = num.partition("-")
    whole = first.isdigit() and (not dash or (kind == "node" and last.isdigit()))
    if kind not in ("rank", "node") or not whole:
        p.fail(
            "target", f'expected "all", "rank:N", "node:N", "node:A-B" or "random", got {text!r}'
        )
    if dash and int(last) <= int(first):
        p.fail("target", f"node:{num}: the range's last node must come after its first")
    target = Target(kind, int(first), int(last) if dash else None)  # type: ignore[arg-type]
    _check_target(target, shape, p)
    return target


def _check_target(target: Target, shape: JobShape, p: Table) -> None:
    kind, index = target.kind, target.nodes[-1] if target.kind == "node" else target.index
    if kind == "rank" and shape.world is not None and index >= shape.world:
        p.fail("target", f"rank {index} does not exist: the job has {shape.world} ranks")
    if kind == "node" and shape.nodes is not None and index >= shape.nodes:
        p.fail("target", f"node {index} does not exist: the job has {shape.nodes} node(s)")
