"""What each failure cost: a run's events and metrics folded into an `Analysis`.

Pure: `RunData` (from `load`) goes in, `Analysis` (see `model`) comes out: per-failure rows,
totals, the job's node events, checkpoint stalls and the Young/Daly interval (`saving`).
Rendering lives in `report_md` (tables) and `plot` (PNG), so `run` pays for neither matplotlib
nor this module until a job ends.

Times on the run's timeline are wall-clock seconds since the `start` event (events carry `ts`,
metrics `t`); latencies between two supervisor events use their monotonic stamps.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from supervisor.reporting.guard_md import guard_rows
from supervisor.reporting.intervals_md import interval_rows
from supervisor.reporting.lifetimes import attempt_lifetimes, lifetimes, restrict, spans
from supervisor.reporting.load import RunData, StepRecord
from supervisor.reporting.model import Analysis, Failure, NodeEvent, Totals
from supervisor.reporting.saving import checkpoints_of, memory_tier, young_daly
from supervisor.reporting.stragglers_md import straggler_rows

DETECTED_BY = {
    "exit": "exit",
    "rank_exit": "exit",
    "hang": "liveness",
    "no_progress": "progress",
    "stop": "stop",
    "guard": "guard",
}
FAILED = ("failure", "bad_input", "diverged")  # attempt_end outcomes (policy.exits.FAILED)


def analyze(data: RunData, baseline: RunData | None = None) -> Analysis:
    ev = data.events
    start = _first(ev, "start")
    t0 = _ts(start) if start else _earliest(data)
    now = _latest(data)
    end_ev = _last(ev, "supervisor_exit")
    records = sorted(data.records, key=lambda r: (r.t, r.attempt))
    productive, best, new_s = 0.0, data.prior_step, {}  # new steps' seconds, by attempt
    for r in records:
        if best is None or r.step > best:
            productive += r.dt
            new_s[r.attempt] = new_s.get(r.attempt, 0.0) + r.dt
            best = r.step
    lives = lifetimes(data, t0, new_s)
    if len(lives) > 1:  # the supervisors' own times, not the gaps between them
        wall = sum(life.wall_s for life in lives)
        end_ev = _last(ev[spans(ev)[-1].first :], "supervisor_exit")
    else:
        wall = (_ts(end_ev) if end_ev else now) - t0
    failures = _failures(ev, records, t0)
    node_events = node_history(ev, t0)
    for f in failures:
        f.then = [n for n in node_events if n.attempt == f.attempt and n.kind != "start"]
    ckpts = checkpoints_of(ev, records)
    worker = data.config.get("worker", {}) if isinstance(data.config, dict) else {}
    save_interval = worker.get("save_interval")
    save_interval = save_interval if isinstance(save_interval, int) else None

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
        reason=str(end_ev["reason"]) if end_ev and end_ev.get("reason") else None,
        final_step=_final_step(done, best),
        productive_s=productive,
        goodput=productive / wall if wall > 0 else 0.0,
        startup_s=startup,
        restarts=sum(1 for e in ev if e.get("event") == "relaunch"),
        failures=len(failures),
        faults=sum(1 for f in failures if f.fault),  # a `slow` or `nan` fault fails nothing
        fired=fired_by_action(ev),
        # and what a supervisor reached beyond where the next took the job up (it was killed)
        lost_steps=sum(f.lost_steps or 0 for f in failures) + sum(x.lost or 0 for x in lives),
        downtime_s=_union(
            [(f.at_s, f.at_s + f.downtime_s) for f in failures if f.downtime_s is not None]
        ),
        recompute_s=sum(f.recompute_s or 0.0 for f in failures),
    )
    newest = None
    if len(lives) > 1:  # the newest supervisor's own part: what its summary says
        prior = max((x.final_step for x in lives[:-1] if x.final_step is not None), default=None)
        newest = analyze(restrict(data, spans(ev)[-1], prior))
    base = analyze(baseline) if baseline is not None else None
    if base is not None:
        totals.baseline_wall_s = base.totals.wall_s
        totals.overhead_s = wall - base.totals.wall_s
        if failures:
            totals.overhead_per_failure_s = totals.overhead_s / len(failures)
    step_s = statistics.median(r.dt for r in records) if records else None
    timed = [x for x in ckpts.saves if x.timed] or ckpts.saves
    mode = "none" if not timed else ("async" if timed[0].is_async else "sync")
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
        guard=guard_rows(ev, t0),
        stragglers=straggler_rows(ev),
        intervals=interval_rows(ev, t0),
        lifetimes=lives,
        newest=newest,
        pool=pool_now(ev),
    )


def fired_by_action(ev: list[dict]) -> dict[str, int]:
    """The `fault` events by action (`{"slow": 3}`): what was injected, failure or not."""
    out: dict[str, int] = {}
    for e in ev:
        if e.get("event") == "fault":
            action = str(e.get("action") or "?")
            out[action] = out.get(action, 0) + 1
    return out


def _final_step(done: dict | None, best: int | None) -> int | None:
    """The step the job is at: `done`'s, else the newest record's (a job finished already,
    started again, says done with no step of its own)."""
    step = (done or {}).get("step")
    if isinstance(step, int) and (best is None or step >= best):
        return step
    return best


def _failures(ev: list[dict], records: list[StepRecord], t0: float) -> list[Failure]:
    by_attempt: dict[int, list[StepRecord]] = {}
    for r in records:
        by_attempt.setdefault(r.attempt, []).append(r)
    out = []
    life = attempt_lifetimes(ev, spans(ev))
    for end in (e for e in ev if e.get("event") == "attempt_end"):
        if end.get("outcome") not in FAILED:
            continue
        a = end.get("attempt")
        if not isinstance(a, int):
            continue
        here = life.get(a, 1)
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
        last = max((x for x in by_attempt if life.get(x) == here), default=a)
        while (
            nxt < last
            and not by_attempt.get(nxt)
            and not _first([e for e in ev if e.get("attempt") == nxt], "first_step")
        ):
            nxt += 1
        if life.get(nxt, here) != here:  # not relaunched: the next supervisor's is no resume
            nxt = -1
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
            said = relaunch.get("mode")  # prepared ranks: their own word
            mode = "warm" if went else (said if said == "prepared" else "cold")
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
                lifetime=here,
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
    out = []
    for span in spans(ev):
        for e in ev[span.first : span.stop]:
            n = _node_event(e, t0)
            if n is not None:
                n.lifetime = span.number
                out.append(n)
    return out


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
        out = _names(pool.get("excluded"))  # an excluded node is never active too
        return NodeEvent("stop", at, attempt, reason=str(e.get("reason") or ""),
                         nodes=[n for n in _names(pool.get("active")) if n not in out],
                         spares=_names(pool.get("spares")), excluded=out)  # fmt: skip
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


# --- small helpers -------------------------------------------------------------------------------
def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _names(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def _pair(v: Any) -> tuple[Any, Any] | None:
    return (v[0], v[1]) if isinstance(v, list) and len(v) == 2 else None


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
