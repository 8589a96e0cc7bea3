"""What one run of `bench/downtime.py` says, from its events and rank 0's metrics: a failure's
row (downtime, detection, relaunch, lost steps, source, cost), the run's steady step, what a
standby's preparation cost the attempt beside it, and the startup parts of a first step.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from supervisor.reporting.model import Failure

PARTS = ("imports", "process_group", "model_build", "warmup", "standby_wait", "choose", "load",
         "first_step")  # fmt: skip


def records(run: Path, attempt: int) -> list[dict]:
    """Rank 0's metrics of `attempt` (a torn last line skipped)."""
    try:
        lines = (run / "attempts" / f"{attempt:03d}" / "metrics-0.jsonl").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def row(evs: list[dict], k: dict, run: Path, failure: Failure | None) -> dict:
    def one(name: str, attempt: int) -> dict | None:
        return next((e for e in evs if e["event"] == name and e.get("attempt") == attempt), None)

    a, n = k["attempt"], k["next"]
    ex = one("exit", a) or one("rank_exit", a) or one("hang", a)
    relaunch = next(e for e in evs if e["event"] == "relaunch" and e.get("after") == a)
    started = one("standby_go", n) or one("launch", n)
    resumed, first = one("resumed", n), one("first_step", n)
    out = {"how": relaunch.get("mode", "cold"), "next": n}
    if not (ex and started and first):
        return {**out, "incomplete": True}
    seen = ex.get("exit_mono", ex.get("detected_mono", ex["mono"]))
    out.update(
        prep_cost=prep_cost(evs, a, n, run),
        downtime=first["mono"] - k["kill"],
        restart=resumed["restart_seconds"] if resumed else None,
        detect=seen - k["kill"],
        relaunch=started["mono"] - seen,
        resumed=resumed["step"] if resumed else 0,
        parts=startup_parts(run / "attempts" / f"{n:03d}" / "metrics-0.jsonl"),
        lost=failure.lost_steps if failure else None,
        source=(failure.resumed_source if failure else None) or (resumed or {}).get("source"),
        cost=None,
    )
    before = failure.step_at_failure if failure else None
    past = [r for r in records(run, n) if before is not None and r["step"] > before]
    if past:
        out["cost"] = past[0]["t"] - k["kill_wall"]
    return out


def steady_step(evs: list[dict], run: Path) -> float | None:
    """The run's steady step: the median `train/dt` of rank 0's steps, leaving out each
    attempt's first (a start's) and every step that overlapped a standby's preparation."""
    launched = {e["attempt"]: e["ts"] for e in evs if e["event"] == "standby_launch"}
    ready = {e["attempt"]: e["ts"] for e in evs if e["event"] == "standby_ready"}
    end = max((e["ts"] for e in evs), default=0.0)
    windows = [(t, ready.get(n, end)) for n, t in launched.items()]
    attempts = sorted({e["attempt"] for e in evs if e["event"] in ("launch", "standby_go")})
    steps = [r for a in attempts for r in records(run, a)[1:]]

    def beside_a_standby(r: dict) -> bool:
        return any(lo < r["t"] and r["t"] - r["train/dt"] < hi for lo, hi in windows)

    dts = [r["train/dt"] for r in steps if not beside_a_standby(r)]
    return statistics.median(dts) if dts else None


def prep_cost(evs: list[dict], a: int, n: int, run: Path) -> float | None:
    """What the standby's preparation cost attempt `a` that it ran beside: the seconds its steps
    took beyond the attempt's own median step while standby `n` prepared (launch -> ready)."""
    launch = next((e for e in evs if e["event"] == "standby_launch" and e["attempt"] == n), None)
    ready = next((e for e in evs if e["event"] == "standby_ready" and e["attempt"] == n), None)
    if launch is None or ready is None:
        return None
    try:
        lines = (run / "attempts" / f"{a:03d}" / "metrics-0.jsonl").read_text().splitlines()
        steps = [json.loads(x) for x in lines][1:]  # not the first: it is a start's
    except (OSError, ValueError):
        return None
    # A step's record is written when it ends: it overlapped the window if it ended after the
    # launch and began before the ready.
    inside = [r for r in steps if launch["ts"] < r["t"] and r["t"] - r["train/dt"] < ready["ts"]]
    outside = [r["train/dt"] for r in steps if r not in inside]
    if not inside or not outside:
        return None
    steady = statistics.median(outside)
    return sum(max(0.0, r["train/dt"] - steady) for r in inside)


def startup_parts(path: Path) -> dict[str, float]:
    try:
        first = json.loads(path.read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return {}
    parts = {p: first[f"startup/{p}"] for p in PARTS if f"startup/{p}" in first}
    if "train/standby_prepare_seconds" in first:
        parts["prepare"] = first["train/standby_prepare_seconds"]
    return parts
