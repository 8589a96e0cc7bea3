"""What each failure cost: a run directory's events and metrics folded into typed rows.

Pure analysis, apart from `load_run` (the only I/O): events.jsonl and every attempt's rank-0
metrics go in, `Analysis` comes out (per-failure rows, totals, checkpoint stalls, the Young/Daly
interval). Rendering lives in `report_md` (tables) and `plot` (PNG), so
`run` pays for neither matplotlib nor this module until a job ends.

Times on the run's timeline are wall-clock seconds since the `start` event (events carry `ts`,
metrics `t`); latencies between two supervisor events use their monotonic stamps.
"""

from __future__ import annotations

import json
import math
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.log.events import load_events, run_dir_events

DETECTED_BY = {
    "exit": "exit",
    "rank_exit": "exit",
    "hang": "liveness",
    "no_progress": "progress",
    "stop": "stop",
}
FAILED = ("failure", "bad_input")  # attempt_end outcomes that are failures


class NotARunDir(ValueError):
    """A path that holds no run (no events.jsonl): reported in one line, exit 2."""


# --- inputs --------------------------------------------------------------------------------------
@dataclass
class StepRecord:
    """One rank-0 metrics line: a step done, when, and the timings the worker attached."""

    attempt: int
    step: int
    t: float
    dt: float
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class RunData:
    """Everything the analysis reads, already parsed: events, metrics, resolved config."""

    run_dir: Path
    events: list[dict[str, Any]]
    records: list[StepRecord]
    config: dict[str, Any]
    skipped_lines: int = 0
    notes: list[str] = field(default_factory=list)  # what the run dir lacks
    skipped_events: int = 0  # lines of events.jsonl that are no event (or fields mistyped)


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; malformed or torn lines are skipped and counted, never raised."""
    run = Path(run_dir)
    try:
        path, missing = run_dir_events(run)
    except ValueError as exc:
        raise NotARunDir(f"{run}: {exc}") from None
    read = load_events(path)
    events = read.events
    records: list[StepRecord] = []
    skipped = 0
    for adir in sorted((run / "attempts").glob("[0-9]*")):
        if not adir.name.isdigit():
            continue
        got, bad = parse_metrics(adir / "metrics-0.jsonl", int(adir.name))
        records += got
        skipped += bad
    try:
        config = tomllib.loads((run / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        config = {}
    config = {k: v for k, v in config.items() if isinstance(v, dict)}  # tables only
    notes = [missing] if missing else []
    if any(e.get("event") == "events_reopened" for e in events):
        notes.append("events.jsonl was deleted or moved while the job ran: earlier events are lost")
    if read.note():
        notes.append(str(read.note()))
    return RunData(run, events, records, config, skipped, notes, read.skipped_count)


def parse_metrics(path: Path, attempt: int) -> tuple[list[StepRecord], int]:
    """(records, lines skipped): a line without an integer step and numeric t/dt is skipped."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return [], 0
    out, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step, t, dt = rec["step"], float(rec["t"]), float(rec.get("train/dt", 0.0))
            if not isinstance(step, int) or not (math.isfinite(t) and math.isfinite(dt)):
                raise ValueError(step)
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        extra = {
            k: float(v)
            for k, v in rec.items()
            if k.startswith(("train/", "startup/"))
            and k not in ("train/dt", "train/tps")
            and isinstance(v, (int, float))
        }
        out.append(StepRecord(attempt, step, t, dt, extra))
    return out, bad


# --- outputs -------------------------------------------------------------------------------------
@dataclass
class Failure:
    """One failed attempt and what it cost, up to the run's getting back to where it was."""

    attempt: int
    at_s: float  # failure time on the run's timeline (the fault's, else the best evidence)
    cause: str  # "fault <name>: <action> <target>" or "natural: <detail>"
    detected_by: str  # exit | liveness | progress
    detection_s: float | None  # failure -> the supervisor's teardown began
    step_at_failure: int | None  # the newest step the failed attempt completed
    resumed_from: int | None  # where the next attempt started (None: not relaunched yet)
    lost_steps: int | None
    restart_s: float | None  # the worker's train/restart_seconds after the relaunch
    downtime_s: float | None  # failure -> the first productive step after resume
    recompute_s: float | None  # first productive step -> step_at_failure done again
    fault: bool = False
    relaunch: str | None = None  # warm (a standby took over) | cold | None (not relaunched)
    resumed_source: str | None = None  # memory | durable (a memory tier), None: not said
    # A hang or no progress: where its ranks' stacks went, and a line per rank (state, place).
    stacks_dir: str | None = None
    stacks: list[str] = field(default_factory=list)
    node: str | None = None  # the node the failure was laid on (attempt_end), None: none
    then: list[NodeEvent] = field(default_factory=list)  # what it did to the nodes

    @property
    def total_s(self) -> float | None:
        if self.downtime_s is None:
            return None
        return self.downtime_s + (self.recompute_s or 0.0)


@dataclass
class NodeEvent:
    """One change to the job's nodes, in the order the supervisor made it: the `start` (active
    and spare), a node excluded, a spare swapped in, a shrink, or the job stopped for want of
    nodes (`give_up` NODES)."""

    kind: str  # start | excluded | swapped | shrink | stop
    at_s: float  # on the run's timeline
    attempt: int | None  # the attempt whose failure made it (None: the start)
    node: str | None = None  # excluded: the node; swapped: the one out
    into: str | None = None  # swapped: the spare that took its place
    count: int | None = None  # excluded: failures laid on the node
    reason: str = ""  # excluded / stop: why
    nodes: list[str] = field(default_factory=list)  # start / shrink: the active nodes after
    spares: list[str] = field(default_factory=list)  # start: the spares; stop: those left
    excluded: list[str] = field(default_factory=list)  # stop: every node out
    world: tuple[int, int] | None = None  # shrink: ranks before, after
    mesh: tuple[str, str] | None = None  # shrink: the parallel layout before, after
    flags: dict[str, Any] = field(default_factory=dict)  # shrink: worker flags overridden
    changes: list[str] = field(default_factory=list)  # shrink: what changed, for people
    batch_kept: bool | None = None  # shrink: the global batch stayed the same

    @property
    def short(self) -> str:
        """A few words for a table cell or a plot label: `excluded n1`, `n1→n3`, …"""
        if self.kind == "excluded":
            return f"excluded {self.node}"
        if self.kind == "swapped":
            return f"{self.node}→{self.into}"
        if self.kind == "shrink":
            return f"shrink to {_count(len(self.nodes), 'node')}"
        if self.kind == "stop":
            return "stopped: too few nodes"
        return f"{_count(len(self.nodes), 'node')}" + (
            f" + {len(self.spares)} spare" if self.spares else ""
        )


@dataclass
class SaveStall:
    """One checkpoint: how long training was blocked for it, and how long until it was marked."""

    step: int
    attempt: int
    save_s: float | None = None  # synchronous save (includes the marker)
    stage_s: float | None = None  # asynchronous: copy to host
    drain_s: float | None = None  # asynchronous: barrier + marker on the main thread
    wait_s: float | None = None  # asynchronous: waiting for the previous save in flight
    marker_s: float | None = None  # save began -> .complete

    @property
    def stall_s(self) -> float:
        parts = (self.save_s, self.stage_s, self.drain_s, self.wait_s)
        return sum(p for p in parts if p is not None)

    @property
    def is_async(self) -> bool:
        return self.save_s is None and self.stage_s is not None


@dataclass
class Checkpoints:
    count: int
    saves: list[SaveStall]
    save_median_s: float | None
    save_max_s: float | None
    stage_median_s: float | None
    stage_max_s: float | None
    drain_median_s: float | None
    drain_max_s: float | None
    stall_median_s: float | None  # per save: sync save, or async stage + drain + wait
    stall_max_s: float | None
    stall_total_s: float
    marker_median_s: float | None
    marker_max_s: float | None


@dataclass
class MemoryTier:
    """What the memory tier cost (`--mem-ckpt-interval`): a copy of each rank's state into
    node-local shared memory. Training waits for the hand-over and for the previous copy (the
    stall); the copy itself runs beside the next step."""

    copies: int
    stall_total_s: float
    stall_median_s: float
    stall_max_s: float
    copy_total_s: float
    copy_median_s: float | None
    copy_max_s: float | None


@dataclass
class Interval:
    """Young/Daly: the checkpoint interval that minimises save cost + expected rework."""

    save_cost_s: float
    mtbf_s: float
    step_s: float  # median step time
    run_interval_steps: int
    young_s: float  # sqrt(2 C M)
    daly_s: float  # sqrt(2 C M) - C (first-order Daly), for C < 2M
    optimal_steps: int
    run_waste: float  # expected fraction lost at the run's interval: C/T + (T + C)/(2M)
    optimal_waste: float
    cost_s: float  # (run_waste - optimal_waste) x wall-clock: what the run's interval cost


@dataclass
class Totals:
    wall_s: float
    finished: bool
    end: str  # supervisor_exit's code name, or "in progress"
    final_step: int | None
    productive_s: float  # train/dt of steps that moved the run forward for the first time
    goodput: float
    startup_s: float | None  # first launch -> first productive step
    restarts: int
    failures: int
    faults: int
    lost_steps: int
    downtime_s: float
    recompute_s: float
    baseline_wall_s: float | None = None
    overhead_s: float | None = None
    overhead_per_failure_s: float | None = None


@dataclass
class Analysis:
    run_dir: Path
    name: str
    failures: list[Failure]
    totals: Totals
    checkpoints: Checkpoints
    interval: Interval | None
    curve: list[tuple[float, int, int]]  # (seconds since start, step, attempt) per record
    skipped_lines: int
    save_interval: int | None
    mode: str  # "sync", "async" or "none" (no checkpoints)
    baseline: Analysis | None = None
    notes: list[str] = field(default_factory=list)  # what the run dir lacks
    node_events: list[NodeEvent] = field(default_factory=list)  # the start's first
    memory: MemoryTier | None = None  # None: no memory tier ran

    @property
    def shows_nodes(self) -> bool:
        """Whether nodes are worth a column and a section: more than one node, a spare, or
        anything done to them. A single-node job's report stays as it was."""
        return any(n.kind != "start" or len(n.nodes) > 1 or n.spares for n in self.node_events)


# --- analysis ------------------------------------------------------------------------------------
def analyze(data: RunData, baseline: RunData | None = None) -> Analysis:
    ev = data.events
    start = _first(ev, "start")
    t0 = _ts(start) if start else _earliest(data)
    now = _latest(data)
    end_ev = _last(ev, "supervisor_exit")
    wall = (_ts(end_ev) if end_ev else now) - t0

    records = sorted(data.records, key=lambda r: (r.t, r.attempt))
    failures = _failures(ev, records, t0)
    node_events = node_history(ev, t0)
    for f in failures:
        f.then = [n for n in node_events if n.attempt == f.attempt and n.kind != "start"]
    ckpts = _checkpoints(ev, records)
    worker = data.config.get("worker", {}) if isinstance(data.config, dict) else {}
    save_interval = worker.get("save_interval")
    save_interval = save_interval if isinstance(save_interval, int) else None

    productive, best = 0.0, None
    for r in records:
        if best is None or r.step > best:
            productive += r.dt
            best = r.step
    first_launch = _first(ev, "launch")
    first_step = _first(ev, "first_step")
    startup = (
        _ts(first_step) - _ts(first_launch) if first_launch and first_step else None
    )  # fmt: skip
    done = _last(ev, "done")
    totals = Totals(
        wall_s=wall,
        finished=end_ev is not None,
        end=str(end_ev.get("code_name")) if end_ev else "in progress",
        final_step=(done or {}).get("step", best),
        productive_s=productive,
        goodput=productive / wall if wall > 0 else 0.0,
        startup_s=startup,
        restarts=sum(1 for e in ev if e.get("event") == "relaunch"),
        failures=len(failures),
        faults=sum(1 for e in ev if e.get("event") == "fault"),
        lost_steps=sum(f.lost_steps or 0 for f in failures),
        downtime_s=_union(
            [(f.at_s, f.at_s + f.downtime_s) for f in failures if f.downtime_s is not None]
        ),
        recompute_s=sum(f.recompute_s or 0.0 for f in failures),
    )
    base = analyze(baseline) if baseline is not None else None
    if base is not None:
        totals.baseline_wall_s = base.totals.wall_s
        totals.overhead_s = wall - base.totals.wall_s
        if failures:
            totals.overhead_per_failure_s = totals.overhead_s / len(failures)
    step_s = statistics.median(r.dt for r in records) if records else None
    mode = "none" if not ckpts.saves else ("async" if ckpts.saves[0].is_async else "sync")
    return Analysis(
        run_dir=data.run_dir,
        name=str(data.config.get("job", {}).get("name", data.run_dir.name))
        if isinstance(data.config, dict)
        else data.run_dir.name,
        failures=failures,
        totals=totals,
        checkpoints=ckpts,
        interval=young_daly(ckpts.stall_median_s, wall, len(failures), step_s, save_interval),
        curve=[(r.t - t0, r.step, r.attempt) for r in records],
        skipped_lines=data.skipped_lines,
        save_interval=save_interval,
        mode=mode,
        baseline=base,
        notes=list(data.notes),
        node_events=node_events,
        memory=memory_tier(records),
    )


def _failures(ev: list[dict], records: list[StepRecord], t0: float) -> list[Failure]:
    by_attempt: dict[int, list[StepRecord]] = {}
    for r in records:
        by_attempt.setdefault(r.attempt, []).append(r)
    out = []
    for end in (e for e in ev if e.get("event") == "attempt_end"):
        if end.get("outcome") not in FAILED:
            continue
        a = end.get("attempt")
        if not isinstance(a, int):
            continue
        mine = [e for e in ev if e.get("attempt") == a]
        teardown = _first(mine, "teardown")
        exit_ev = _first(mine, "exit")
        finding = _first(mine, "hang") or _first(mine, "no_progress")
        fault = _last(
            [e for e in mine if e.get("action") != "slow" and _ts(e) <= _ts(teardown or end)],
            "fault",
        )
        own = by_attempt.get(a, [])
        if fault is not None:
            failed_at = _ts(fault)
            cause = f"fault {fault.get('name')}: {fault.get('action')} {fault.get('target')}"
        elif exit_ev is not None and "exit_mono" in exit_ev:
            failed_at = _wall(exit_ev, exit_ev["exit_mono"])
            cause = f"natural: {end.get('detail')}"
        else:  # a hang or a stall with no declared fault: its last sign of life
            failed_at = own[-1].t if own else _ts(finding or end)
            cause = f"natural: {end.get('detail')}"
        detected_at = _wall(teardown, teardown["start_mono"]) if teardown else _ts(end)
        if finding is not None and isinstance(finding.get("detected_mono"), (int, float)):
            # The finding itself: the stacks collected after it (before the teardown) are
            # downtime, not detection.
            detected_at = _wall(finding, finding["detected_mono"])
        steps = [r.step for r in own]
        at_failure = end.get("max_step")
        if steps and (at_failure is None or max(steps) > at_failure):
            at_failure = max(steps)
        # The attempt that got going again: the relaunch's (a standby has its own number), one
        # dying before a step skipped.
        relaunch = next(
            (e for e in ev if e.get("event") == "relaunch" and e.get("after") == a), None
        )
        nxt = (
            relaunch["attempt"] if relaunch and isinstance(relaunch.get("attempt"), int) else a + 1
        )
        last = max(by_attempt, default=a)
        while (
            nxt < last
            and not by_attempt.get(nxt)
            and not _first([e for e in ev if e.get("attempt") == nxt], "first_step")
        ):
            nxt += 1
        resumed = _first([e for e in ev if e.get("attempt") == nxt], "resumed")
        nxt_end = _first([e for e in ev if e.get("attempt") == nxt], "attempt_end")
        nxt_first = _first([e for e in ev if e.get("attempt") == nxt], "first_step")
        after = by_attempt.get(nxt, [])
        resumed_from, source = None, None
        if resumed is not None:
            resumed_from, source = resumed.get("step"), resumed.get("source")
        elif nxt_end is not None and nxt_end.get("resume_step") is not None:
            resumed_from, source = nxt_end["resume_step"], nxt_end.get("resume_source")
        elif after:
            resumed_from = after[0].step - 1
        restart = resumed.get("restart_seconds") if resumed else None
        if restart is None and after:
            restart = after[0].extra.get("train/restart_seconds")
        first_t = nxt_first and _ts(nxt_first)
        if after:  # the worker's own clock: the first step's record
            first_t = after[0].t
        downtime = first_t - failed_at if first_t else None
        recompute = None
        if after and at_failure is not None and resumed_from is not None:
            again = [r for r in after if r.step <= at_failure]
            recompute = (again[-1].t - after[0].t) if again else 0.0
        lost = None
        if at_failure is not None and resumed_from is not None:
            lost = max(0, at_failure - resumed_from)
        detected = end.get("detected_by")
        mode = None
        if relaunch is not None:
            went = any(e.get("event") == "standby_go" and e.get("attempt") == nxt for e in ev)
            mode = "warm" if went else "cold"
        out.append(
            Failure(
                attempt=a,
                at_s=failed_at - t0,
                cause=cause,
                detected_by=DETECTED_BY.get(str(detected), str(detected)),
                detection_s=detected_at - failed_at,
                step_at_failure=at_failure,
                resumed_from=resumed_from,
                lost_steps=lost,
                restart_s=restart,
                downtime_s=downtime,
                recompute_s=recompute,
                fault=fault is not None,
                relaunch=mode,
                resumed_source=source if isinstance(source, str) else None,
                **_stacks_of(finding),
                node=_laid_on(end),
            )
        )
    return out


def _laid_on(end: dict) -> str | None:
    """The node attempt_end laid the failure on (`node`, else `attributed.node`)."""
    node = end.get("node")
    if node is None and isinstance(end.get("attributed"), dict):
        node = end["attributed"].get("node")
    return node if isinstance(node, str) else None


def node_history(ev: list[dict], t0: float) -> list[NodeEvent]:
    """The job's node events in order: each `start` (active, spares), then what was done."""
    return [n for n in (_node_event(e, t0) for e in ev) if n is not None]


def _node_event(e: dict, t0: float) -> NodeEvent | None:
    name, at = e.get("event"), _ts(e) - t0
    attempt = e.get("attempt") if isinstance(e.get("attempt"), int) else None
    if name == "start":
        if not isinstance(e.get("nodes"), list):
            return None  # a run from before nodes were recorded
        return NodeEvent("start", at, None, nodes=_names(e.get("nodes")),
                         spares=_names(e.get("spares")))  # fmt: skip
    if name == "node_excluded":
        count = e.get("count") if isinstance(e.get("count"), int) else None
        return NodeEvent("excluded", at, attempt, node=_str(e.get("node")), count=count,
                         reason=str(e.get("reason") or ""))  # fmt: skip
    if name == "node_swapped":
        return NodeEvent("swapped", at, attempt, node=_str(e.get("out")), into=_str(e.get("into")))
    if name == "shrink":
        flags = e.get("flags")
        kept = e.get("batch_kept")
        return NodeEvent(
            "shrink", at, attempt, nodes=_names(e.get("nodes")), world=_pair(e.get("world")),
            mesh=_pair(e.get("mesh")), flags=dict(flags) if isinstance(flags, dict) else {},
            changes=_names(e.get("changes")), batch_kept=kept if isinstance(kept, bool) else None,
        )  # fmt: skip
    if name == "give_up" and e.get("code_name") == "NODES":
        pool = e.get("nodes") if isinstance(e.get("nodes"), dict) else {}
        return NodeEvent("stop", at, attempt, reason=str(e.get("reason") or ""),
                         nodes=_names(pool.get("active")), spares=_names(pool.get("spares")),
                         excluded=_names(pool.get("excluded")))  # fmt: skip
    return None


def pool_now(ev: list[dict]) -> tuple[list[str], list[str], dict[str, int | None]] | None:
    """(active, spares, excluded node -> failures laid on it) after the newest `start`'s node
    events; None for a run that recorded no nodes."""
    starts = [i for i, e in enumerate(ev) if e.get("event") == "start"]
    # A supervisor started again in the same run dir begins again with the config's nodes.
    history = node_history(ev[starts[-1] if starts else 0 :], 0.0)
    if not history or history[0].kind != "start":
        return None
    active, spares = list(history[0].nodes), list(history[0].spares)
    excluded: dict[str, int | None] = {}
    for n in history[1:]:
        if n.kind == "excluded" and n.node is not None:
            excluded[n.node] = n.count
        elif n.kind == "swapped" and n.into is not None:  # the spare takes the node's place
            spares = [x for x in spares if x != n.into]
            active = [n.into if x == n.node else x for x in active]
            if n.into not in active:
                active.append(n.into)
        elif n.kind == "shrink" and n.nodes:
            active = list(n.nodes)
        elif n.kind == "stop":
            active, spares = list(n.nodes), list(n.spares)
            excluded.update({x: excluded.get(x) for x in n.excluded})
    return [x for x in active if x not in excluded], spares, excluded


def _stacks_of(finding: dict | None) -> dict[str, Any]:
    if finding is None or not isinstance(finding.get("stacks_dir"), str):
        return {}
    lines = finding.get("stacks")
    lines = [x for x in lines if isinstance(x, str)] if isinstance(lines, list) else []
    if finding.get("stacks_error"):
        lines.append(f"not collected: {finding['stacks_error']}")
    return {"stacks_dir": finding["stacks_dir"], "stacks": lines}


def _checkpoints(ev: list[dict], records: list[StepRecord]) -> Checkpoints:
    saves: dict[tuple[int, int], SaveStall] = {}
    order: list[SaveStall] = []
    for r in records:
        x = r.extra
        if "train/ckpt_save_seconds" in x or "train/ckpt_stage_seconds" in x:
            s = SaveStall(step=r.step - 1, attempt=r.attempt)
            s.save_s = x.get("train/ckpt_save_seconds")
            s.stage_s = x.get("train/ckpt_stage_seconds")
            s.wait_s = x.get("train/ckpt_wait_seconds")
            saves[(r.attempt, s.step)] = s
            order.append(s)
        if "train/ckpt_drain_seconds" in x:  # the oldest staged save of this attempt not drained
            pending = [
                s for s in order if s.attempt == r.attempt and s.is_async and s.drain_s is None
            ]
            if pending:
                pending[0].drain_s = x["train/ckpt_drain_seconds"]
                if "train/ckpt_marker_seconds" in x:
                    pending[0].marker_s = x["train/ckpt_marker_seconds"]
    # save -> marker from the supervisor's own events: rank 0 entered `save`, then `.complete`
    began: dict[tuple[int, int], dict] = {}
    for e in ev:
        if e.get("event") == "phase" and e.get("phase") == "save":
            began[(e.get("attempt"), e.get("step"))] = e
        elif e.get("event") == "ckpt_complete":
            key = (e.get("attempt"), e.get("step"))
            s, b = saves.get(key), began.get(key)
            if s is not None and b is not None and s.marker_s is None:
                s.marker_s = e.get("mono", 0.0) - b.get("mono", 0.0)
    for s in order:  # a sync save's marker is its last act
        if s.marker_s is None and s.save_s is not None:
            s.marker_s = s.save_s
    marked = {(e.get("attempt"), e.get("step")) for e in ev if e.get("event") == "ckpt_complete"}

    def stat(values: list[float | None], fn) -> float | None:
        vs = [v for v in values if v is not None]
        return fn(vs) if vs else None

    med, mx = statistics.median, max
    stalls = [s.stall_s for s in order]
    return Checkpoints(
        count=len(marked) if marked else len(order),
        saves=order,
        save_median_s=stat([s.save_s for s in order], med),
        save_max_s=stat([s.save_s for s in order], mx),
        stage_median_s=stat([s.stage_s for s in order], med),
        stage_max_s=stat([s.stage_s for s in order], mx),
        drain_median_s=stat([s.drain_s for s in order], med),
        drain_max_s=stat([s.drain_s for s in order], mx),
        stall_median_s=stat(stalls, med),
        stall_max_s=stat(stalls, mx),
        stall_total_s=sum(stalls),
        marker_median_s=stat([s.marker_s for s in order], med),
        marker_max_s=stat([s.marker_s for s in order], mx),
    )


MEM_STALL = "train/mem_ckpt_stall_seconds"
MEM_COPY = "train/mem_ckpt_copy_seconds"


def memory_tier(records: list[StepRecord]) -> MemoryTier | None:
    """The memory tier's copies from the rank-0 metrics (each on the record after its step)."""
    stalls = [r.extra[MEM_STALL] for r in records if MEM_STALL in r.extra]
    if not stalls:
        return None
    copies = [r.extra[MEM_COPY] for r in records if MEM_COPY in r.extra]
    return MemoryTier(
        copies=len(stalls),
        stall_total_s=sum(stalls),
        stall_median_s=statistics.median(stalls),
        stall_max_s=max(stalls),
        copy_total_s=sum(copies),
        copy_median_s=statistics.median(copies) if copies else None,
        copy_max_s=max(copies) if copies else None,
    )


def young_daly(
    save_cost: float | None,
    wall: float,
    n_failures: int,
    step_s: float | None,
    interval_steps: int | None,
) -> Interval | None:
    """The optimal interval for this run's save cost and failure rate (None without both)."""
    if not save_cost or not n_failures or not step_s or not interval_steps or wall <= 0:
        return None
    mtbf = wall / n_failures
    young = math.sqrt(2 * save_cost * mtbf)
    daly = young - save_cost if save_cost < 2 * mtbf else mtbf
    run_t = interval_steps * step_s + save_cost

    def waste(t: float) -> float:
        return save_cost / t + (t + save_cost) / (2 * mtbf)

    run_waste, opt_waste = waste(run_t), waste(max(daly, save_cost))
    return Interval(
        save_cost_s=save_cost,
        mtbf_s=mtbf,
        step_s=step_s,
        run_interval_steps=interval_steps,
        young_s=young,
        daly_s=daly,
        optimal_steps=max(1, round(daly / step_s)),
        run_waste=run_waste,
        optimal_waste=opt_waste,
        cost_s=max(0.0, run_waste - opt_waste) * wall,
    )


# --- small helpers -------------------------------------------------------------------------------
def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _names(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def _pair(v: Any) -> tuple[Any, Any] | None:
    return (v[0], v[1]) if isinstance(v, list) and len(v) == 2 else None


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ts(e: dict | None) -> float:
    v = (e or {}).get("ts")
    return float(v) if isinstance(v, (int, float)) else 0.0


def _wall(e: dict, mono: float) -> float:
    """A monotonic stamp of this host as wall time, through the event's own (ts, mono) pair."""
    m = e.get("mono")
    if not isinstance(m, (int, float)) or not isinstance(mono, (int, float)):
        return _ts(e)
    return _ts(e) - m + mono


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by possibly overlapping spans (downtimes of cascading failures)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _first(ev: list[dict], name: str) -> dict | None:
    return next((e for e in ev if e.get("event") == name), None)


def _last(ev: list[dict], name: str) -> dict | None:
    return next((e for e in reversed(ev) if e.get("event") == name), None)


def _earliest(data: RunData) -> float:
    stamps = [_ts(e) for e in data.events if "ts" in e] + [r.t for r in data.records]
    return min(stamps) if stamps else 0.0


def _latest(data: RunData) -> float:
    stamps = [_ts(e) for e in data.events if "ts" in e] + [r.t for r in data.records]
    return max(stamps) if stamps else 0.0
