"""report.png: steps against wall-clock minutes with each failure marked, the stall per save, and
the "auto" checkpoint intervals over time when the run had any.

matplotlib (Agg) is imported here only, so `run` and `report --no-plot` never pay for it.
"""

from __future__ import annotations

from pathlib import Path

from supervisor.reporting.model import Analysis

RUN_COLOR = "tab:blue"
BASE_COLOR = "0.55"
FAIL_COLOR = "tab:red"
NODE_COLOR = "tab:purple"
STOP_COLOR = "tab:green"


def _segments(curve: list[tuple[float, int, int]]) -> list[tuple[list[float], list[int]]]:
    """One line per attempt, so the gap between attempts is not drawn as training."""
    out: dict[int, tuple[list[float], list[int]]] = {}
    for t, step, attempt in curve:
        xs, ys = out.setdefault(attempt, ([], []))
        xs.append(t / 60)
        ys.append(step)
    return list(out.values())


# What a failure's box says, under the steps' axes: its words defined where they are read.
FAILURE_KEY = (
    "a failure's box: #n and how it was detected; steps lost: the step reached less the step "
    "resumed from;\nrestart: the new ranks' start to their first step (train/restart_seconds); "
    "down: the failure to the first productive step"
)


def untimed_note(a: Analysis) -> str | None:
    """Why some saves have no bar: no step after them timed their stall (a failure, a stop or
    the job's end came first)."""
    steps = [s.step for s in a.checkpoints.saves if not s.timed]
    if not steps or not any(s.timed for s in a.checkpoints.saves):
        return None
    shown = ", ".join(str(x) for x in steps[:8]) + (", ..." if len(steps) > 8 else "")
    return (
        f"no bar: the save{'' if len(steps) == 1 else 's'} of step{'' if len(steps) == 1 else 's'}"
        f" {shown}: no step came after to time the stall (a failure, a stop or the job's end)"
    )  # fmt: skip


def plot(a: Analysis, out: Path, labels: tuple[str, str] = ("run", "baseline")) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(a, labels)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(a: Analysis, labels: tuple[str, str] = ("run", "baseline")):
    """report.png's figure (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tuned = bool(a.intervals)
    fig, axes = plt.subplots(
        3 if tuned else 2,
        1,
        figsize=(11, 10 if tuned else 7.5),
        gridspec_kw={"height_ratios": [2.2, 1, 1] if tuned else [2.2, 1]},
        constrained_layout=True,
    )
    ax, bx = axes[0], axes[1]
    if tuned:
        _plot_intervals(axes[2], a)
    if a.baseline is not None:
        for i, (xs, ys) in enumerate(_segments(a.baseline.curve)):
            label = f"{labels[1]} ({a.baseline.totals.wall_s / 60:.2f} min)" if i == 0 else None
            ax.plot(xs, ys, color=BASE_COLOR, ls="--", lw=1.6, label=label)
    for i, (xs, ys) in enumerate(_segments(a.curve)):
        label = f"{labels[0]} ({a.totals.wall_s / 60:.2f} min)" if i == 0 else None
        ax.plot(xs, ys, color=RUN_COLOR, lw=2, label=label)
    top = max([s for _, s, _ in a.curve] or [1])
    for n, f in enumerate(a.failures, 1):
        x = f.at_s / 60
        ax.axvline(x, color=FAIL_COLOR, ls=":", lw=1.2)
        if f.downtime_s:  # shade the downtime: failure -> first productive step
            ax.axvspan(x, x + f.downtime_s / 60, color=FAIL_COLOR, alpha=0.08,
                       label="downtime (failure → first step)" if n == 1 else None)  # fmt: skip
        y = f.step_at_failure if f.step_at_failure is not None else top / 2
        ax.plot([x], [y], marker="X", color=FAIL_COLOR, ms=9, zorder=5, ls="none",
                label="failure (step reached)" if n == 1 else None)  # fmt: skip
        text = (
            f"#{n} {f.detected_by}\n{steps_lost(f.lost_steps)}\nrestart {_v(f.restart_s, 1)} s"
            f"\ndown {_v(f.downtime_s, 1)} s"
        )
        ax.annotate(
            text,
            (x, y),
            # Low points get their label above, high ones below: never over the axis or title.
            xytext=(6, 10 if y < 0.55 * top else -10),
            textcoords="offset points",
            fontsize=8.5,
            color=FAIL_COLOR,
            va="bottom" if y < 0.55 * top else "top",
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": FAIL_COLOR, "alpha": 0.85},
        )
    _mark_node_events(ax, a)
    _mark_lifetimes(ax, a)
    ax.set_xlabel("wall-clock (minutes since start)" + (f"\n{FAILURE_KEY}" if a.failures else ""),
                  fontsize=9)  # fmt: skip
    ax.set_ylabel("training step")
    t = a.totals
    ax.set_title(
        f"{a.name}: {t.failures} failure{'' if t.failures == 1 else 's'}, "
        f"{steps_lost(t.lost_steps)}, "
        f"goodput {t.goodput:.0%}" + ("" if t.finished else " (in progress)"),
        fontsize=11,
    )
    ax.grid(alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if node_marks(a):  # room above the steps for the node labels
        ax.set_ylim(top=ax.get_ylim()[1] * 1.15)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=9)

    saves = [s for s in a.checkpoints.saves if s.timed]  # the last step's has no stall said
    if saves:
        steps = [s.step for s in saves]
        width = max(
            1.0,
            0.7 * min((b - c for b, c in zip(steps[1:], steps, strict=False) if b > c), default=1),
        )
        if any(s.is_async for s in saves):
            stage = [s.stage_s or 0.0 for s in saves]
            drain = [s.drain_s or 0.0 for s in saves]
            bx.bar(steps, stage, width, color="tab:green", label="async stage")
            bx.bar(steps, drain, width, bottom=stage, color="tab:olive", label="async drain")
        else:
            bx.bar(steps, [s.save_s or 0.0 for s in saves], width, color="tab:orange",
                   label="sync save")  # fmt: skip
        med = a.checkpoints.stall_median_s or 0.0
        bx.axhline(med, color="k", lw=0.8, ls="--", label=f"median {med:.3f} s")
        bx.legend(loc="upper right", fontsize=8.5)
    else:
        n = len(a.checkpoints.saves)  # saves no later step timed: counted, no stall known
        text = f"{n} save{'' if n == 1 else 's'}, none timed" if n else "no checkpoints"
        bx.text(0.5, 0.5, text, ha="center", va="center", transform=bx.transAxes)
    note = untimed_note(a)
    bx.set_xlabel("checkpoint step" + (f"\n{note}" if note else ""), fontsize=9)
    bx.set_ylabel("training stall per save (s)")
    bx.grid(alpha=0.3, axis="y")
    return fig


TIER_COLORS = {"memory": "tab:cyan", "durable": "tab:orange"}


def _plot_intervals(cx, a: Analysis) -> None:
    """Each "auto" tier's interval (steps) as decided over the run, failures marked."""
    end = a.totals.wall_s / 60
    for tier in dict.fromkeys(r.tier for r in a.intervals):
        rows = [r for r in a.intervals if r.tier == tier and r.t_s is not None]
        if not rows:
            continue
        xs = [r.t_s / 60 for r in rows] + [max(end, rows[-1].t_s / 60)]
        ys = [r.new for r in rows] + [rows[-1].new]
        cx.step(xs, ys, where="post", lw=2, color=TIER_COLORS.get(tier), label=f"{tier} tier")
    for n, f in enumerate(a.failures):
        cx.axvline(f.at_s / 60, color=FAIL_COLOR, ls=":", lw=1.2,
                   label="failure" if n == 0 else None)  # fmt: skip
    values = [r.new for r in a.intervals]
    if values and max(values) >= 20 * max(1, min(values)):
        cx.set_yscale("log")
    cx.set_xlabel("wall-clock (minutes since start)")
    cx.set_ylabel('"auto" interval (steps)')
    cx.set_xlim(left=0)
    cx.grid(alpha=0.3)
    cx.legend(loc="upper right", fontsize=8.5)


def node_marks(a: Analysis) -> list[tuple[float, str]]:
    """(minutes, label) per failure's node changes: `excluded n1` / `n1→n3` / `shrink to 2
    nodes` together, as they happen at once."""
    marks: dict[tuple[int | None, float], list[str]] = {}
    for n in a.node_events:
        if n.kind != "start":
            key = (n.attempt, round(n.at_s, 1))
            marks.setdefault(key, []).append(n.short)
    return [(at / 60, "\n".join(words)) for (_, at), words in marks.items()]


def _mark_node_events(ax, a: Analysis) -> None:
    """A dash-dot line and a label 10 points below the top of the axes (its box clear of the
    edge; the axes leave room above the steps), left of the line (a failure's label goes to its
    right), or right of it early in the run (the axes begin at 0)."""
    early = 0.25 * a.totals.wall_s / 60
    for i, (x, text) in enumerate(node_marks(a)):
        ax.axvline(x, color=NODE_COLOR, ls="-.", lw=1.2,
                   label="node excluded / swapped / shrink" if i == 0 else None)  # fmt: skip
        left = x < early
        ax.annotate(
            text,
            (x, 1.0),
            xycoords=ax.get_xaxis_transform(),
            xytext=(4 if left else -4, -10),
            textcoords="offset points",
            ha="left" if left else "right",
            va="top",
            fontsize=8.5,
            color=NODE_COLOR,
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": NODE_COLOR, "alpha": 0.85},
        )


def lifetime_marks(a: Analysis) -> list[tuple[float, str]]:
    """(minutes, label) for each graceful stop and each supervisor's start after the first:
    what the gap in the steps between them is."""
    marks = [(s.at_s / 60, f"stopped ({s.signal or 'signal'})") for s in a.stops]
    for life in a.lifetimes[1:]:
        how = "continued" if life.continued else "started again"
        marks.append((life.at_s / 60, f"supervisor {life.number} ({how})"))
    return sorted(marks)


def _mark_lifetimes(ax, a: Analysis) -> None:
    """A dashed line and a label low on the axes (a node's label is at the top)."""
    for i, (x, text) in enumerate(lifetime_marks(a)):
        ax.axvline(x, color=STOP_COLOR, ls="--", lw=1.2,
                   label="stop / supervisor start" if i == 0 else None)  # fmt: skip
        ax.text(x, 0.02, text, transform=ax.get_xaxis_transform(), ha="right", va="bottom",
                rotation=90, fontsize=8.5, color=STOP_COLOR)  # fmt: skip


def steps_lost(n: int | None) -> str:
    """`0 steps lost`, `1 step lost`, `12 steps lost` (`steps lost: ?` when unknown)."""
    if n is None:
        return "steps lost: ?"
    return f"{n} step{'' if n == 1 else 's'} lost"


def _v(v: float | int | None, digits: int = 0) -> str:
    if v is None:
        return "?"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


PHASE_COLORS = {"baseline": BASE_COLOR, "sync": "tab:orange", "async": "tab:green"}


def plot_comparison(phases: dict[str, Analysis], out: Path, name: str = "") -> Path:
    """All phases on one time axis, failures marked; sync save vs async stage + drain below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(
        2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [2.2, 1]}, constrained_layout=True
    )
    for p, a in phases.items():
        color = PHASE_COLORS.get(p, "tab:blue")
        for i, (xs, ys) in enumerate(_segments(a.curve)):
            ax.plot(xs, ys, color=color, lw=2 if p != "baseline" else 1.6,
                    ls="--" if p == "baseline" else "-",
                    label=f"{p} ({a.totals.wall_s / 60:.2f} min, {steps_lost(a.totals.lost_steps)})"
                    if i == 0 else None)  # fmt: skip
        for f in a.failures:
            if f.step_at_failure is None:
                continue
            x = f.at_s / 60
            ax.plot([x], [f.step_at_failure], marker="X", color=color, ms=8, mec="k", zorder=5)
            ax.annotate(
                f"{steps_lost(f.lost_steps)} / restart {_v(f.restart_s, 1)} s",
                (x, f.step_at_failure),
                xytext=(5, -12 if p == "sync" else 8),
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
    ax.set_xlabel("wall-clock (minutes since the phase's start)")
    ax.set_ylabel("training step")
    ax.set_title(f"{name}: steps over time per phase (X: a failure, its steps lost / restart)")
    ax.grid(alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=9)

    offset = {"sync": -0.2, "async": 0.2}
    drew = False
    for p in ("sync", "async"):
        a = phases.get(p)
        if a is None or not a.checkpoints.saves:
            continue
        saves = [s for s in a.checkpoints.saves if s.timed]
        steps = [s.step for s in saves]
        gap = min((b - c for b, c in zip(steps[1:], steps, strict=False) if b > c), default=1)
        w = max(0.4, 0.38 * gap)
        xs = [s + offset[p] * gap for s in steps]
        if p == "sync":
            bx.bar(xs, [s.stall_s for s in saves], w, color=PHASE_COLORS[p], label="sync save")
        else:
            stage = [s.stage_s or 0.0 for s in saves]
            rest = [s.stall_s - st for s, st in zip(saves, stage, strict=True)]
            bx.bar(xs, stage, w, color=PHASE_COLORS[p], label="async stage")
            bx.bar(xs, rest, w, bottom=stage, color="tab:olive", label="async drain (+wait)")
        drew = True
    if drew:
        bx.legend(loc="upper right", fontsize=8.5)
    else:
        bx.text(0.5, 0.5, "no checkpoints", ha="center", va="center", transform=bx.transAxes)
    bx.set_xlabel("checkpoint step")
    bx.set_ylabel("training stall per save (s)")
    bx.grid(alpha=0.3, axis="y")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
