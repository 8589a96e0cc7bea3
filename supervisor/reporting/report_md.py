"""report.md: an `Analysis` as markdown tables (also what `run` prints when a job ends)."""

from __future__ import annotations

from pathlib import Path

from supervisor.reporting.guard_md import guard_md
from supervisor.reporting.intervals_md import intervals_md
from supervisor.reporting.lifetimes_md import lifetimes_md, stop_line
from supervisor.reporting.model import Analysis, Failure, NodeEvent, Totals
from supervisor.reporting.stragglers_md import stragglers_md
from supervisor.reporting.summary import pool_text


def _s(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _i(v: int | None) -> str:
    return "–" if v is None else str(v)


def _min(v: float | None) -> str:
    return "–" if v is None else f"{v / 60:.2f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


LIFETIMES_NOTE = (
    "More than one supervisor ran this job in this run dir (continued with `run --resume`, after "
    "its supervisor stopped or was killed). Each counts its own restarts against "
    "`max_restarts`; the totals below are the whole run, its wall-clock the supervisors' own "
    "times (not the gaps between them)."
)
FAILURE_HEADER = [
    "#", "attempt", "at (min)", "cause", "detected by", "detection (s)", "step at failure",
    "resumed from", "relaunch", "lost steps", "restart (s)", "downtime (s)", "recompute (s)",
    "total (s)",
]  # fmt: skip


def failure_row(i: int, f: Failure) -> list[str]:
    return [
        str(i), str(f.attempt), _min(f.at_s), f.cause, f.detected_by, _s(f.detection_s, 3),
        _i(f.step_at_failure), resumed_from(f), f.relaunch or "–", _i(f.lost_steps),
        _s(f.restart_s),
        _s(f.downtime_s), _s(f.recompute_s), _s(f.total_s),
    ]  # fmt: skip


def resumed_from(f: Failure) -> str:
    """`12`, or `12 (memory)` / `10 (durable)` when the ranks said where the state came from."""
    if f.resumed_from is None or f.resumed_source is None:
        return _i(f.resumed_from)
    return f"{f.resumed_from} ({f.resumed_source})"


def failures_md(a: Analysis) -> list[str]:
    stops = [f"Stopped: {stop_line(s, a.several)}." for s in a.stops]
    if not a.failures:
        return ["No failures.", *stops]
    rows = [failure_row(i + 1, f) for i, f in enumerate(a.failures)]
    header = list(FAILURE_HEADER)
    if a.shows_nodes:
        at = FAILURE_HEADER.index("cause") + 1
        header = [*FAILURE_HEADER[:at], "node", *FAILURE_HEADER[at:], "then"]
        rows = [
            [*r[:at], f.node or "–", *r[at:], then_note(f)]
            for r, f in zip(rows, a.failures, strict=True)
        ]
    if a.several:  # which supervisor's failure each is
        header.insert(1, "supervisor")
        for r, f in zip(rows, a.failures, strict=True):
            r.insert(1, str(f.lifetime))
    return table(header, rows) + ([""] + stops if stops else [])


def then_note(f: Failure) -> str:
    """What the failure did to the nodes: `excluded n1; n1→n3`, or `–`."""
    return "; ".join(n.short for n in f.then) or "–"


def nodes_md(a: Analysis) -> list[str]:
    """A line per node event: the start's active and spare nodes, each exclusion, swap and
    shrink, and the stop for want of nodes (empty for a job that never had more than one)."""
    if not a.shows_nodes:
        return []
    out = []
    for n in a.node_events:
        out += [f"- {node_line(n, a.several)}", *(f"  - {c}" for c in n.changes)]
    if a.pool is not None:  # the one set of nodes status and the summary show too
        out.append(f"- at the end: {pool_text(a.pool)}")
    return out


def node_line(n: NodeEvent, lifetimes: bool = False) -> str:
    """One node event for people, led by when and after which attempt it happened (and, in a
    run dir of several supervisors, which one's start it was)."""
    after = "before the first launch" if n.attempt is None else f"after attempt {n.attempt}"
    start = f"start of supervisor {n.lifetime}" if lifetimes else "start"
    when = start if n.kind == "start" else f"{_min(n.at_s)} min, {after}"
    return f"{when}: {_node_what(n)}"


def _node_what(n: NodeEvent) -> str:
    if n.kind == "start":
        spares = f"; spare {_names(n.spares)}" if n.spares else "; no spares"
        return f"{len(n.nodes)} active ({_names(n.nodes)}){spares}"
    if n.kind == "excluded":
        count = f" ({n.count} failures)" if n.count else ""
        if n.reason and (n.count is None or str(n.count) in n.reason):
            count = ""  # the reason says how many
        return f"excluded **{n.node}**{count}" + (f": {n.reason}" if n.reason else "")
    if n.kind == "swapped":
        return f"spare **{n.into}** took {n.node}'s place"
    if n.kind == "shrink":
        return _shrink_what(n)
    return (
        f"**stopped** (exit 6, NODES): {n.reason or 'too few nodes'}; active {_names(n.nodes)}, "
        f"spares {_names(n.spares)}, excluded {_names(n.excluded)}"
    )


def _shrink_what(n: NodeEvent) -> str:
    parts = [f"**shrink** to {len(n.nodes)} node(s) ({_names(n.nodes)})"]
    if n.world is not None:
        parts.append(f"world {n.world[0]} → {n.world[1]} ranks")
    if n.mesh is not None:
        parts.append(f"mesh {n.mesh[0]} → {n.mesh[1]}")
    flags = ", ".join(f"{k} = {v}" for k, v in n.flags.items())
    parts.append(f"flags {flags}" if flags else "no worker flags changed")
    if n.batch_kept is not None:
        parts.append("global batch kept" if n.batch_kept else "global batch changed")
    return "; ".join(parts)


def _names(names: list[str]) -> str:
    return ", ".join(names) or "none"


def stacks_md(a: Analysis) -> list[str]:
    """A line per hang or no progress: each rank's state and where its main thread was when it
    was found, and where the stack files are (empty when no failure left stacks)."""
    out = []
    for i, f in enumerate(a.failures):
        if f.stacks_dir is None:
            continue
        where = _below(f.stacks_dir, a.run_dir)
        ranks = "; ".join(f.stacks) or "none collected"
        out.append(f"- #{i + 1} (attempt {f.attempt}, {f.detected_by}): {ranks} (`{where}`)")
    return out


def _below(path: str, run_dir: Path) -> str:
    """`attempts/001/stacks/` when the path lies in the run dir."""
    try:
        return str(Path(path).resolve().relative_to(Path(run_dir).resolve())) + "/"
    except ValueError:
        return path


def totals_md(a: Analysis) -> list[str]:
    t = a.totals
    rows = [
        ["state", _state(t)],
        ["final step", _i(t.final_step)],
        ["wall-clock (min)", _min(t.wall_s)],
        ["productive (min)", _min(t.productive_s)],
        ["goodput (productive ÷ wall-clock)", f"{t.goodput:.1%}"],
        ["first launch → first step (s)", _s(t.startup_s)],
        ["restarts", _restarts(a)],
        ["failures (of them injected faults)", f"{t.failures} ({t.faults})"],
        *([["faults injected (by action)", _fired(t.fired)]] if t.fired else []),
        ["lost steps", str(t.lost_steps)],
        ["downtime (s)", _s(t.downtime_s)],
        ["recomputing lost steps (s)", _s(t.recompute_s)],
        ["checkpoint stall (s)", _s(a.checkpoints.stall_total_s)],
    ]
    if a.memory is not None:
        rows.append(["memory tier stall (s)", _s(a.memory.stall_total_s)])
    if t.baseline_wall_s is not None:
        rows += [
            ["baseline wall-clock (min)", _min(t.baseline_wall_s)],
            ["overhead vs baseline (min)", _min(t.overhead_s)],
            ["overhead per failure (s)", _s(t.overhead_per_failure_s)],
        ]
    if a.skipped_lines:
        rows.append(["metrics lines skipped (malformed)", str(a.skipped_lines)])
    return table(["total", "value"], rows)


def _fired(fired: dict[str, int]) -> str:
    """`4 (kill 1, slow 3)`: every `fault` event, a failure or not (a `slow` one is none)."""
    parts = ", ".join(f"{action} {n}" for action, n in sorted(fired.items()))
    return f"{sum(fired.values())} ({parts})"


def _restarts(a: Analysis) -> str:
    """`3`, or with several supervisors `3 (1 + 2: each its own budget)`."""
    if not a.several:
        return str(a.totals.restarts)
    parts = " + ".join(str(life.restarts) for life in a.lifetimes)
    return f"{a.totals.restarts} ({parts}: each supervisor its own budget)"


def _state(t: Totals) -> str:
    if not t.finished:
        return "in progress (what it has so far)"
    return f"{t.end}: {t.ended_because}" if t.ended_because else t.end


def checkpoints_md(a: Analysis) -> list[str]:
    c = a.checkpoints
    if not c.saves:
        return ["No checkpoints."]
    rows = [
        ["saves (marked)", f"{len(c.saves)} ({c.count})", ""],
        ["stall per save: sync save / async stage+drain", _s(c.stall_median_s, 3),
         _s(c.stall_max_s, 3)],
        ["sync save (s)", _s(c.save_median_s, 3), _s(c.save_max_s, 3)],
        ["async stage (s)", _s(c.stage_median_s, 3), _s(c.stage_max_s, 3)],
        ["async drain (s)", _s(c.drain_median_s, 3), _s(c.drain_max_s, 3)],
        ["save → marker (s)", _s(c.marker_median_s, 3), _s(c.marker_max_s, 3)],
    ]  # fmt: skip
    untimed = [str(s.step) for s in c.saves if not s.timed]
    return table(["checkpoints", "median", "max"], rows) + [
        "",
        "saves: every durable save, timed by the metrics of the step after it, or seen marked "
        "complete (the last step's, a graceful stop's and one a failure came right after have "
        "no step after them: counted, not timed); marked: those whose `.complete` marker rank 0 "
        "reported."
        + (f" Not timed (no bar on report.png): step {', '.join(untimed)}." if untimed else ""),
    ]


def memory_md(a: Analysis) -> list[str]:
    """The memory tier's copies: how long training waited for them, how long they took."""
    m = a.memory
    if m is None:
        return []
    return [
        f"{m.copies} copies into node-local memory; training stalled {m.stall_total_s:.2f} s in "
        f"all for them. The copy itself runs beside the next step.",
        "",
        *table(
            ["memory tier", "median", "max", "total"],
            [
                [
                    "stall per copy (s)",
                    _s(m.stall_median_s, 3),
                    _s(m.stall_max_s, 3),
                    _s(m.stall_total_s, 2),
                ],
                ["copy (s)", _s(m.copy_median_s, 3), _s(m.copy_max_s, 3), _s(m.copy_total_s, 2)],
            ],
        ),  # fmt: skip
    ]


def interval_md(a: Analysis) -> list[str]:
    iv = a.interval
    if iv is None and any(r.tier == "durable" for r in a.intervals):
        return ['Young/Daly interval: the durable interval was "auto", tuned as the job ran '
                "(below)."]  # fmt: skip
    if iv is None:
        why = "no failures" if not a.failures else "no checkpoint cost or interval measured"
        return [f"Young/Daly interval: not computed ({why})."]
    return [
        f"Save cost C = {iv.save_cost_s:.3f} s (median stall per save), observed MTBF "
        f"M = {iv.mtbf_s:.1f} s, median step {iv.step_s * 1000:.0f} ms.",
        "",
        *table(
            ["interval", "seconds", "steps", "expected waste"],
            [
                ["Young √(2CM)", _s(iv.young_s, 1), str(round(iv.young_s / iv.step_s)), ""],
                [
                    "Daly √(2CM) − C (optimal)",
                    _s(iv.daly_s, 1),
                    str(iv.optimal_steps),
                    f"{iv.optimal_waste:.1%}",
                ],
                [
                    "this run",
                    _s(iv.run_interval_steps * iv.step_s, 1),
                    str(iv.run_interval_steps),
                    f"{iv.run_waste:.1%}",
                ],
            ],
        ),  # fmt: skip
        "",
        f"The run's interval cost {iv.cost_s:.1f} s ({iv.cost_s / 60:.2f} min) against the "
        "optimum (expected waste C/T + (T + C)/2M, times the wall-clock).",
    ]


def render(a: Analysis) -> str:
    lines = [f"# Run report: {a.name}", "", f"`{a.run_dir}` · checkpoints: {a.mode}", ""]
    lines += [f"**Note:** {note}" for note in a.notes] + ([""] if a.notes else [])
    lives = lifetimes_md(a.lifetimes)
    if lives:
        lines += ["## Supervisor lifetimes", "", LIFETIMES_NOTE, "", *lives, ""]
    lines += ["## Per failure", "", *failures_md(a), ""]
    lines += [
        "detection: failure (the fault's time, else the launcher's exit or the last step) → "
        "the supervisor's finding (a hang or no progress) or teardown began (an exit); "
        "relaunch: warm (the standby took over), prepared (prepared ranks became the ranks: "
        "imports paid, process group new) or cold (new processes); "
        "downtime: failure → first productive step after resume; total: "
        "downtime + recomputing the lost steps."
        + (
            " node: the node the failure was laid on (–: none); then: what it did to the nodes."
            if a.shows_nodes
            else ""
        ),
        "",
    ]
    nodes = nodes_md(a)
    if nodes:
        lines += ["## Nodes", "", *nodes, ""]
    stacks = stacks_md(a)
    if stacks:
        lines += ["## Stacks at each hang or no progress", "", *stacks, ""]
    guard = guard_md(a.guard)
    if guard:
        lines += ["## Numerical guard", "", *guard, ""]
    stragglers = stragglers_md(a.stragglers)
    if stragglers:
        lines += ["## Stragglers", "", *stragglers, ""]
    lines += ["## Totals", "", *totals_md(a), ""]
    lines += ["## Checkpoints", "", *checkpoints_md(a), ""]
    memory = memory_md(a)
    if memory:
        lines += ["## Memory tier", "", *memory, ""]
    lines += ["## Checkpoint interval (Young/Daly)", "", *interval_md(a), ""]
    tuned = intervals_md(a.intervals)
    if tuned:
        lines += ['## Checkpoint intervals ("auto"), over time', "", *tuned, ""]
    return "\n".join(lines)


def write_report(
    run_dir: str | Path,
    baseline: str | Path | None = None,
    out: str | Path | None = None,
    png: bool = True,
) -> tuple[Analysis, str, list[Path]]:
    """Analyse a run (against a baseline), write report.md (and report.png) into `out`."""
    from supervisor.reporting.analysis import analyze
    from supervisor.reporting.load import load_run

    data = load_run(run_dir)
    base = load_run(baseline) if baseline is not None else None
    a = analyze(data, base)
    text = render(a)
    dest = Path(out) if out is not None else Path(run_dir)
    dest.mkdir(parents=True, exist_ok=True)
    written = [dest / "report.md"]
    written[0].write_text(text)
    if png:
        from supervisor.reporting.plot import plot

        written.append(plot(a, dest / "report.png"))
    return a, text, written


def _median(values: list[float | None]) -> float | None:
    vs = sorted(v for v in values if v is not None)
    if not vs:
        return None
    mid = len(vs) // 2
    return vs[mid] if len(vs) % 2 else (vs[mid - 1] + vs[mid]) / 2


def comparison(name: str, phases: dict[str, Analysis], codes: dict[str, int]) -> str:
    """The experiment's one comparison: per phase, per failure, and sync vs async stall."""
    lines = [f"# Experiment: {name}", ""]
    rows = []
    for p, a in phases.items():
        t = a.totals
        rows.append([
            p, f"{t.end} ({codes.get(p, '?')})", _min(t.wall_s), _min(t.overhead_s),
            _s(t.overhead_per_failure_s, 1), str(t.failures), str(t.lost_steps),
            _s(_median([f.restart_s for f in a.failures])),
            _s(_median([f.downtime_s for f in a.failures])), f"{t.goodput:.1%}",
            str(len(a.checkpoints.saves)), _s(a.checkpoints.stall_median_s, 3),
            _s(a.checkpoints.stall_total_s, 1),
        ])  # fmt: skip
    lines += ["## Phases", ""]
    lines += table(
        ["phase", "end (exit)", "wall-clock (min)", "overhead vs baseline (min)",
         "overhead per failure (s)", "failures", "lost steps", "restart median (s)",
         "downtime median (s)", "goodput", "saves", "stall per save median (s)",
         "stall total (s)"],
        rows,
    )  # fmt: skip
    for p, a in phases.items():
        if p == "baseline":
            continue
        lines += ["", f"## Per failure: {p}", "", *failures_md(a)]
    sync, asy = phases.get("sync"), phases.get("async")
    lines += ["", "## Checkpoint stall: sync save vs async stage + drain", ""]
    if sync and asy and sync.checkpoints.saves and asy.checkpoints.saves:
        s, a = sync.checkpoints, asy.checkpoints
        ratio = (a.stall_median_s or 0.0) / s.stall_median_s if s.stall_median_s else None
        lines += table(
            ["", "median (s)", "max (s)", "total (s)"],
            [
                ["sync save", _s(s.save_median_s, 3), _s(s.save_max_s, 3),
                 _s(s.stall_total_s, 2)],
                ["async stage", _s(a.stage_median_s, 3), _s(a.stage_max_s, 3), ""],
                ["async drain", _s(a.drain_median_s, 3), _s(a.drain_max_s, 3), ""],
                ["async stage + drain", _s(a.stall_median_s, 3), _s(a.stall_max_s, 3),
                 _s(a.stall_total_s, 2)],
                ["save → marker: sync / async", _s(s.marker_median_s, 3),
                 _s(a.marker_median_s, 3), ""],
            ],
        )  # fmt: skip
        if ratio is not None:
            lines += ["", f"async ÷ sync stall per save (medians): **{ratio:.2f}**"]
    else:
        lines.append("Needs both a sync and an async phase with checkpoints.")
    lines += ["", "## Lost steps", ""]
    lines += [
        f"- {p}: {a.totals.lost_steps} in all; per failure "
        f"{', '.join(_i(f.lost_steps) for f in a.failures) or 'none'} "
        f"(resumed from {', '.join(resumed_from(f) for f in a.failures) or '–'})"
        for p, a in phases.items()
        if p != "baseline"
    ]
    return "\n".join(lines) + "\n"
