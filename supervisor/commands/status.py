"""`status`: where a run stands, from its events, its resolved config, the newest records of
its metrics and its checkpoint dir. Reads only: a running job is never touched."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

from contracts import ckpt_files, fences, locks
from contracts.exit_codes import ExitCode
from supervisor.commands.tail import events_path
from supervisor.log import events as events_mod
from supervisor.reporting.stragglers_md import straggler_rows, stragglers_lines
from supervisor.settings import config as config_mod


def cmd_status(args: argparse.Namespace) -> int:
    path, missing = events_path(args.run_dir)
    run_dir = Path(args.run_dir)
    read = events_mod.load_events(path)
    events = read.events
    for note in (missing, read.note()):
        if note:
            print(f"note: {note}")
    try:
        resolved = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        resolved = {}
    resolved = {k: v for k, v in resolved.items() if isinstance(v, dict)}  # tables only
    for line in status_lines(events, resolved, run_dir):
        print(line)
    return ExitCode.DONE


def status_lines(events: list[dict], resolved: dict, run_dir: Path) -> list[str]:
    """The status report (pure over the events and the resolved config, plus a ckpt scan).
    Attempts, restarts and the state are the newest supervisor's (each counts its own budget);
    the others' are a line each."""
    # Here, not at the top: `run` imports this module and reads no report until the end.
    from supervisor.reporting.lifetimes import lifetimes, ran, spans
    from supervisor.reporting.lifetimes_md import status_lines as lifetime_lines
    from supervisor.reporting.lifetimes_md import stop_line
    from supervisor.reporting.load import RunData

    lives = lifetimes(RunData(run_dir, events, [], resolved), _first_ts(events), {})
    mine = events[spans(events)[-1].first :]
    starts = [e for e in mine if e.get("event") == "start"]
    # An attempt starts cold (`launch`) or as a standby told to go (`standby_go`).
    launches = [e for e in mine if e.get("event") in ("launch", "standby_go")]
    ends = [e for e in mine if e.get("event") == "supervisor_exit"]
    max_restarts = starts[-1].get("max_restarts") if starts else None
    if not isinstance(max_restarts, int):
        max_restarts = resolved.get("restart", {}).get("max_restarts")
    max_restarts = max_restarts if isinstance(max_restarts, int) else None
    restarts = sum(1 for e in mine if e.get("event") == "relaunch")
    last_start = starts[-1] if starts else {}
    name = resolved.get("job", {}).get("name", "?")
    holder = locks.lock_holder(run_dir)  # the supervisor that owns the run dir now
    if holder is not None:
        state = f"running (supervisor pid {holder.get('pid')} on {holder.get('host')})"
    elif ends:
        end = ends[-1]
        state = f"finished: {end.get('code_name')} (exit {end.get('code')}): {end.get('reason')}"
    elif last_start and _alive(last_start.get("pid")):
        state = f"running (supervisor pid {last_start.get('pid')})"
    elif last_start:
        state = "ended without a final event (the supervisor was killed?)"
    elif events or any((run_dir / "attempts").glob("[0-9]*")):
        state = "not running (the events that would say how it ended are lost)"
    else:
        state = "not started"
    out = [f"run:      {run_dir}", f"job:      {name}", f"state:    {state}"]
    out += lifetime_lines(lives)
    reopened = sum(1 for e in events if e.get("event") == "events_reopened")
    if reopened:
        out.append(f"events:   events.jsonl was recreated {reopened} time(s): earlier events lost")
    left = "?" if max_restarts is None else max(0, max_restarts - restarts)
    out.append(f"attempts: {len(launches)}   restarts: {restarts} of {max_restarts} (left {left})")
    out += nodes_lines(events)
    out += stragglers_lines(straggler_rows(events))
    ckpt_step, ckpt = _newest_checkpoint(resolved, events)
    seen = steps_seen(events, run_dir)
    trained = ran(events)
    if trained:  # a standby never told to go, or prepared ranks, reached nothing
        seen = {a: step for a, step in seen.items() if a in trained}
    step = step_line(seen, ckpt_step)
    if step:
        out.append(f"step:     {step}")
    out.append(f"checkpoint: {ckpt}")
    out += limits_lines(mine, resolved)
    out += failure_lines(events, len(lives) > 1)
    stops = [life.stop for life in lives if life.stop is not None]
    if stops:
        out.append(f"stopped:  {stop_line(stops[-1], len(lives) > 1)}")
    return out


def failure_lines(events: list[dict], lifetimes_shown: bool) -> list[str]:
    """`last failure: attempt 0: fault nl: node_loss n1 (exit 1; detected by exit; reached 50;
    attempt 1 resumed from 40 (partner))` and its stacks. A graceful stop is no failure."""
    failures = [e for e in events if e.get("event") == "attempt_end"
                and e.get("outcome") not in ("success", "stopped")]  # fmt: skip
    if not failures:
        return ["last failure: none"]
    f = failures[-1]
    a = f.get("attempt")
    fault = next((e for e in reversed(events) if e.get("event") == "fault"
                  and e.get("attempt") == a and e.get("action") != "slow"
                  and e.get("ts", 0) <= f.get("ts", 0)), None)  # fmt: skip
    what = str(f.get("detail"))
    if fault is not None:
        what = f"fault {fault.get('name')}: {fault.get('action')} {fault.get('target')} ({what})"
    source = f" ({f['resume_source']})" if isinstance(f.get("resume_source"), str) else ""
    facts = [f"detected by {f.get('detected_by')}",
             f"it ran from step {f.get('resume_step')}{source} to {f.get('max_step')}"]  # fmt: skip
    later = events[events.index(f) + 1 :]
    relaunch = next((e for e in later if e.get("event") == "relaunch"
                     and e.get("after", a) == a), None)  # fmt: skip
    nxt = relaunch.get("attempt") if relaunch else None
    resumed = next((e for e in events if e.get("event") == "resumed"
                    and e.get("attempt") == nxt), None)  # fmt: skip
    if resumed is not None:
        source = f" ({resumed['source']})" if isinstance(resumed.get("source"), str) else ""
        facts.append(f"attempt {nxt} resumed from {resumed.get('step')}{source}")
    elif relaunch is not None:
        facts.append(f"attempt {nxt} relaunched")
    else:
        facts.append("not relaunched")
    if lifetimes_shown:
        where = lifetime_of(events, f)
        facts.append(f"supervisor {where}")
    return [f"last failure: attempt {a}: {what} ({'; '.join(facts)})", *stacks_lines(events, a)]


def lifetime_of(events: list[dict], event: dict) -> int:
    """The number of the supervisor lifetime an event of `events` belongs to."""
    from supervisor.reporting.lifetimes import spans

    at = next(i for i, e in enumerate(events) if e is event)
    return next(s.number for s in spans(events) if s.first <= at < s.stop)


def _first_ts(events: list[dict]) -> float:
    stamps = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    return min(stamps, default=0.0)


def nodes_lines(events: list[dict]) -> list[str]:
    """`nodes: active …; spares …; excluded n1 (2 failures)`, from the newest start and the node
    events after it; nothing for a job that never had more than one node, a spare or one out."""
    # Not for `run`: it reads no report until the end.
    from supervisor.reporting.analysis import pool_now
    from supervisor.reporting.summary import pool_text

    pool = pool_now(events)
    if pool is None:
        return []
    active, spares, excluded = pool
    if len(active) <= 1 and not spares and not excluded:
        return []
    return [f"nodes:    {pool_text(pool)}"]


def limits_lines(events: list[dict], resolved: dict) -> list[str]:
    """The "auto" limits in force in the newest attempt: learned (`auto_limit` events), or
    still at their maximum. Nothing when the config has none."""
    heartbeat = resolved.get("heartbeat", {})
    progress, cap = heartbeat.get("progress", {}), heartbeat.get("auto_max", {})
    progress = progress if isinstance(progress, dict) else {}
    defaults = config_mod.AutoMaxConfig()
    asked = [("timeout_s", heartbeat.get("timeout_s"))] + [
        (p, progress.get(p)) for p in ("train", "save")
    ]
    names = [name for name, value in asked if value == config_mod.AUTO]
    if not names:
        return []
    launches = [e for e in events if e.get("event") in ("launch", "standby_go")]
    newest = launches[-1].get("attempt") if launches else None
    learned = {
        e.get("limit"): e
        for e in events
        if e.get("event") == "auto_limit" and e.get("attempt") == newest and newest is not None
    }
    out = []
    for name in names:
        e = learned.get(name)
        if e is None:
            most = cap.get(name, getattr(defaults, name)) if isinstance(cap, dict) else None
            shown = f"{most:g}" if isinstance(most, (int, float)) else "?"
            out.append(f"{name} {shown} s (auto: its maximum until learned)")
            continue
        basis = ", ".join(
            f"{k} {e[k]:g}" for k in ("p99_step_s", "p99_beat_gap_s", "longest_save_s", "samples")
            if isinstance(e.get(k), (int, float))
        )  # fmt: skip
        where = "while training" if name == "timeout_s" else f"phase {name}"
        seconds = e.get("seconds")
        shown = f"{seconds:g}" if isinstance(seconds, (int, float)) else "?"
        out.append(f"{name} {shown} s (auto, {where}; from {basis})")
    return [("limits:   " if i == 0 else "          ") + line for i, line in enumerate(out)]


def stacks_lines(events: list[dict], attempt: object) -> list[str]:
    """The stacks a hang or no progress of `attempt` left (where, and a line per rank)."""
    found = [
        e
        for e in events
        if e.get("event") in ("hang", "no_progress") and e.get("attempt") == attempt
    ]
    if not found or "stacks_dir" not in found[-1]:
        return []
    e = found[-1]
    out = [f"  stacks: {e['stacks_dir']}"]
    if e.get("stacks_error"):
        out.append(f"    not collected: {e['stacks_error']}")
    lines = e.get("stacks")
    if isinstance(lines, list):
        out += [f"    {line}" for line in lines if isinstance(line, str)]
    return out


def steps_seen(events: list[dict], run_dir: Path) -> dict[int, int]:
    """The newest step each attempt is known to have reached: from any event that names a step
    (`attempt_end`'s max_step too) and the last record of each of its metrics files (one a
    step: progress events come seconds apart, and a standby's newer attempt has none yet)."""
    seen: dict[int, int] = {}

    def saw(attempt: object, step: object) -> None:
        if isinstance(attempt, int) and isinstance(step, int) and not isinstance(step, bool):
            seen[attempt] = max(step, seen.get(attempt, step))

    for e in events:
        saw(e.get("attempt"), e.get("step"))
        if e.get("event") == "attempt_end":
            saw(e.get("attempt"), e.get("max_step"))
    for adir in (run_dir / "attempts").glob("[0-9]*"):
        # Rank 0 steps with every rank; the others' files (--metrics-all-ranks: one a rank)
        # are read only when it has none.
        files = [adir / "metrics-0.jsonl"] if (adir / "metrics-0.jsonl").is_file() else []
        for path in files or adir.glob("metrics-*.jsonl"):
            if adir.name.isdigit():
                saw(int(adir.name), _last_metrics_record(path).get("step"))
    return seen


def step_line(seen: dict[int, int], ckpt_step: int | None) -> str | None:
    """`85 (attempt 3)`: the newest attempt that stepped and its newest step, never older than
    the newest complete checkpoint (the ranks resume from it), and what an earlier attempt
    reached beyond it (the steps a failure lost)."""
    if not seen:
        return None if ckpt_step is None else f"{ckpt_step} (the newest checkpoint)"
    attempt = max(seen)
    step = seen[attempt]
    if ckpt_step is not None and ckpt_step > step:
        return f"{ckpt_step} (the newest checkpoint; attempt {attempt} reached {step})"
    further = max(seen.values())
    if further > step:
        earlier = max(a for a, s in seen.items() if s == further)
        return f"{step} (attempt {attempt}; attempt {earlier} had reached {further})"
    return f"{step} (attempt {attempt})"


def _last_metrics_record(path: Path) -> dict:
    """The last whole JSON line of a metrics file (read from its end: it may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().split(b"\n")
    except OSError:
        return {}
    return next(events_mod.json_objects(reversed(lines)), {})


def _newest_checkpoint(resolved: dict, events: list[dict]) -> tuple[int | None, str]:
    """(step, how status shows it) of the newest complete checkpoint: from the checkpoint dir,
    else the `ckpt_complete` events."""
    ckpt_dir = resolved.get("worker", {}).get("ckpt_dir")
    if isinstance(ckpt_dir, str) and ckpt_dir and Path(ckpt_dir).is_dir():
        root = Path(ckpt_dir)
        fenced = fences.read_all(root)  # what a resume refuses (a cut-off rank's) is not shown
        found = ckpt_files.resume_candidates(ckpt_files.scan(root))
        found = [f for f in found if fences.late_step(f.path, fenced) is None]
        if found:
            return found[0].step, f"step {found[0].step} ({ckpt_dir}/{found[0].path.name})"
    marks = [e["step"] for e in events if e.get("event") == "ckpt_complete" and "step" in e]
    marks = [m for m in marks if isinstance(m, int)]
    return (max(marks), f"step {max(marks)} (from events)") if marks else (None, "none")


def _alive(pid: object) -> bool:
    if not isinstance(pid, int):
        return False
    import psutil

    return psutil.pid_exists(pid)
