"""The few lines `run` prints when a job ends: what failed, what each failure cost, goodput,
and where the full report is. Read in ten seconds; `report.md` keeps every table."""

from __future__ import annotations

from pathlib import Path

from supervisor.reporting.guard_md import guard_line
from supervisor.reporting.lifetimes_md import stop_line, summary_lines
from supervisor.reporting.model import Analysis, Failure, NodeEvent


def summary(a: Analysis, written: list[Path]) -> str:
    """The run's end in a few lines; with several supervisor lifetimes in the run dir, the
    newest's own (its failures, nodes, saves) and a line for each and for the whole."""
    own = a.newest or a
    t = own.totals
    state = t.end if t.finished else "in progress"
    step = t.final_step if t.final_step is not None else a.totals.final_step
    trained = t.productive_s > 0 or t.end != "DONE"
    lines = [
        "",
        f"== {a.name}: {state} at step {_n(step)} in {_duration(t.wall_s)}, "
        + (f"goodput {t.goodput:.0%} ==" if trained else "nothing left to train =="),
    ]
    lines += summary_lines(a.lifetimes)
    if a.several:
        w = a.totals
        lines.append(
            f"The whole run: {_count(len(a.lifetimes), 'supervisor')}, {_duration(w.wall_s)} "
            f"running, goodput {w.goodput:.0%}, {_count(w.failures, 'failure')}, "
            f"{_count(w.restarts, 'relaunch', 'es')}, {_count(w.lost_steps, 'step')} lost."
        )
    lines += [f"Note: {note}" for note in own.notes]
    if t.ended_because:
        lines.append(f"Diverged: {t.ended_because}")
    lines += _failure_lines(own)
    lines += [f"Stopped: {stop_line(s, False)}." for s in own.stops]
    if own.shows_nodes:
        lines += [_node_line(n) for n in own.node_events]
        if own.pool is not None:
            lines.append(f"  at the end: {pool_text(own.pool)}")
    c = own.checkpoints
    if c.saves:
        lines.append(
            f"Checkpoints: {len(c.saves)} saves ({own.mode}), training stalled "
            f"{_s(c.stall_median_s)} per save (median)."
        )
    m = own.memory
    if m is not None:
        lines.append(
            f"Memory tier: {m.copies} cop{'y' if m.copies == 1 else 'ies'}, "
            f"training stalled {m.stall_total_s:.1f} s in all ({m.stall_median_s * 1000:.0f} ms "
            f"per copy, median); a copy took {_ms(m.copy_median_s)} (median)."
        )
    guard = guard_line(own.guard)
    if guard:
        lines.append(guard)
    lines.append("Report: " + ", ".join(_shown(p) for p in written))
    lines.append(f"Look closer: python -m supervisor tail|status|report {_shown(a.run_dir)}")
    return "\n".join(lines)


def _failure_lines(a: Analysis) -> list[str]:
    """`2 failures (1 injected), ...:` and a row each (with its node, and its stacks)."""
    t = a.totals
    if not a.failures:
        return ["No failures."]
    injected = sum(f.fault for f in a.failures)
    lines = [
        f"{_count(len(a.failures), 'failure')} ({injected} injected), "
        f"{_count(t.restarts, 'relaunch', 'es')}, {_count(t.lost_steps, 'step')} lost, "
        f"{t.downtime_s:.1f} s of downtime:"
    ]
    header = ["#", "failure", "detected by", "in", "relaunch", "downtime", "lost", "resumed"]
    rows = [_row(i + 1, f) for i, f in enumerate(a.failures)]
    if a.shows_nodes:  # the node each failure was laid on, after the failure
        header.insert(2, "node")
        for r, f in zip(rows, a.failures, strict=True):
            r.insert(2, f.node or "–")
    lines += _columns(header, rows)
    lines += [
        f"  #{i + 1} stacks: {'; '.join(f.stacks) or 'none collected'}"
        for i, f in enumerate(a.failures)
        if f.stacks_dir is not None
    ]
    return lines


def pool_text(pool: tuple[list[str], list[str], dict[str, int | None]]) -> str:
    """`active n0, n2; spares none; excluded n1 (2 failures)`: the one set of nodes the
    summary, the report and `status` all show."""
    active, spares, excluded = pool
    out = [f"{n} ({_count(c, 'failure')})" if c else n for n, c in excluded.items()]
    return (
        f"active {', '.join(active) or 'none'}; spares {', '.join(spares) or 'none'}; "
        f"excluded {', '.join(out) or 'none'}"
    )


def _shown(path: Path) -> str:
    """Relative to the working directory where it lies below it: short enough to copy."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _row(i: int, f: Failure) -> list[str]:
    cause = f.cause.removeprefix("fault ").removeprefix("natural: ")
    return [
        str(i),
        cause if len(cause) <= 48 else cause[:47] + "…",
        f.detected_by,
        _s(f.detection_s),
        f.relaunch or "–",
        _s(f.downtime_s),
        _n(f.lost_steps),
        _resumed(f),
    ]


def _node_line(n: NodeEvent) -> str:
    """`Nodes: n0, n1, n2 (spare n3)` for the start, then a line per change after a failure."""
    if n.kind == "start":
        spares = f" (spare {', '.join(n.spares)})" if n.spares else ""
        return f"Nodes: {', '.join(n.nodes)}{spares}"
    what = n.short
    if n.kind == "excluded" and n.count:
        what += f" ({_count(n.count, 'failure')} laid on it)"
    elif n.kind == "excluded" and n.reason:
        what += f" ({n.reason})"
    elif n.kind == "swapped":
        what = f"spare {n.into} in for {n.node}"
    elif n.kind == "shrink":
        what += f" ({', '.join(n.nodes)})"
        if n.world is not None:
            what += f", world {n.world[0]} → {n.world[1]}"
        what += "".join(f", {k} = {v}" for k, v in n.flags.items())
        if n.batch_kept is not None:
            what += ", global batch kept" if n.batch_kept else ", global batch changed"
    elif n.kind == "stop" and n.reason:
        what += f": {n.reason}"
    when = "before the first launch" if n.attempt is None else f"after attempt {n.attempt}"
    return f"  {when}: {what}"


def _resumed(f: Failure) -> str:
    if f.resumed_from is None:
        return "–"
    source = f" ({f.resumed_source})" if f.resumed_source else ""
    return f"step {f.resumed_from}{source}"


def _columns(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]  # fmt: skip


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} s"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.0f} ms"


def _n(v: int | None) -> str:
    return "–" if v is None else str(v)


def _count(n: int, word: str, plural: str = "s") -> str:
    return f"{n} {word}{'' if n == 1 else plural}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
