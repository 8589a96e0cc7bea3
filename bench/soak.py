"""Goodput under a storm of failures: the same training for the same wall time, clean and under
a seeded failure trace, for the project and for torchrun.

Each system trains the debug preset on CPU, a durable save every 10 steps, for `--duration`
seconds of wall time counted from rank 0's first step, once clean and once under the trace:

  project   `python -m supervisor run` on a generated config: everything else its defaults
            (warm standby, prepared ranks with a spare, ...), plus `--set KEY=VALUE` (TOML
            values, passed as given: `--set worker.mem_ckpt_interval=1`); the trace given by
            its own fault engine (`at_s`: its newest clean window's start-up plus the trace
            time)
  torchrun  `torchrun --standalone --max-restarts` with the same worker flags, plus
            `--pg-timeout` (it notices a stopped rank only when a collective times out) and
            `--torchrun-set KEY=VALUE` (`--torchrun-set mem_ckpt_interval=1`: the memory tier);
            the trace given from outside by signals to its ranks

Traces (seeded: `--seed`; one failure every `--rate` seconds +- 30 %, the same times for both
systems; each waits until the job trains again after the one before):
  --kills   SIGKILL of every training rank; 2 ranks on one node
  --mixed   kills, one rank SIGKILLed alone, SIGSTOP hangs, stalls inside a step, `nan`,
            `slow` and `node_loss`, in a seeded mix; 3 emulated nodes x 1 rank + 1 spare.
            torchrun runs 3 ranks on one host; the kinds it cannot be given as such are
            approximated or left out, and the output says how (soak_trace.TORCHRUN_GIVEN)

Figures, per system: progress (the highest step rank 0 recorded by the window's end), goodput
(progress under the trace over the same system's clean progress), per failure its kind,
detection, downtime (failure -> the next attempt's first step), steps lost, the relaunch (warm,
prepared or cold) and where the resume came from (memory, partner or durable), and its cost:
the seconds from it to the next failure (or the window's end) less the clean time of the steps
gained meanwhile (the costs add up to the whole deficit). The work redone: the steps in flight
at the failures that ended an attempt and the steps they lost, in seconds, and the goodput a
window whose only loss that was would have (its ceiling: no relaunch however quick does better;
soak_figures.redone). Bit-exactness: every record's loss
against the clean run's at the same step (same system); after a `nan` against the worker run
alone with the skipped data positions (soak_reference). Then the ratio project / torchrun.
`--runs N` repeats everything and gives medians. Each run is A's traced window, A's clean,
B's clean and B's traced (soak_figures.window_order), the next run with A and B swapped; the
ratio is the median of the runs' paired ratios (the ratio of the medians beside it). The last
line is JSON.

Usage: python bench/soak.py [--kills | --mixed] [--rate S] [--duration 150] [--seed 0]
           [--runs 1] [--systems project,torchrun] [--set KEY=VALUE ...]
           [--torchrun-set KEY=VALUE ...] [--no-clean] [--startup-s S] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import tomllib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The bench's own modules, beside this script (a script's folder is on sys.path).
import soak_project  # noqa: E402
import soak_reference  # noqa: E402
import soak_torchrun  # noqa: E402
from soak_figures import (  # noqa: E402
    Numeric,
    ceiling_over,
    exactness,
    goodput,
    interval_costs,
    median,
    numerics,
    pace,
    progress,
    redone,
    run_ratios,
    skip_positions,
    window_order,
)
from soak_run import Outcome  # noqa: E402
from soak_trace import KILLS, MIXED, TORCHRUN_GIVEN, Shape, make_trace  # noqa: E402

SHAPES = {"kills": Shape(nodes=1, ranks_per_node=2), "mixed": Shape(3, 1, spares=1)}
RATES = {"kills": 15.0, "mixed": 30.0}
STARTUP_GUESS_S = 5.0  # the project's launch -> first step, when no clean run measured it


def main() -> None:
    args = parse()
    which = "mixed" if args.mixed else "kills"
    shape = SHAPES[which]
    rate = args.rate or RATES[which]
    trace = make_trace(MIXED if args.mixed else KILLS, rate_s=rate, duration_s=args.duration,
                       seed=args.seed, shape=shape)  # fmt: skip
    print(f"trace --{which}: {len(trace)} failures, every {rate:g} s +- 30 %, seed {args.seed}, "
          f"{args.duration:g} s from the first step; {shape.nodes} node(s) x "
          f"{shape.ranks_per_node} rank(s) + {shape.spares} spare(s)")  # fmt: skip
    for f in trace:
        print(f"  {f.at_s:7.2f} s  {f.kind:<9} {'' if f.target is None else f.target}")
    for kind in sorted({f.kind for f in trace} & set(TORCHRUN_GIVEN)):
        if "torchrun" in args.systems and kind not in ("kill", "kill_rank", "hang"):
            print(f"  torchrun, {kind}: {TORCHRUN_GIVEN[kind]}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="es-soak-"))
    results: dict[str, list] = {s: [None] * args.runs for s in args.systems}
    done: dict[tuple[int, str, bool], Outcome] = {}
    start_ups: dict[str, float] = {}  # each system's newest clean start-up
    try:
        order = window_order(args.systems, args.runs, not args.no_clean, timed="project")
        for i, system, traced in order:
            tmp = root / f"{i}-{system}"
            if traced:
                startup = args.startup_s or start_ups.get(system) or STARTUP_GUESS_S
                done[i, system, True] = window(args, system, trace, shape, tmp / "trace", startup)
            else:
                done[i, system, False] = window(args, system, [], shape, tmp / "clean", None)
                if done[i, system, False].startup_s:
                    start_ups[system] = done[i, system, False].startup_s
            if (i, system, True) in done and (args.no_clean or (i, system, False) in done):
                clean = done.pop((i, system, False), None)
                results[system][i] = figures(args, done.pop((i, system, True)), clean, tmp)
                show_run(system, i, results[system][i])
    finally:
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    summary = {s: summarize(rs) for s, rs in results.items()}
    for s, sm in summary.items():
        show_summary(s, sm)
    ratio = ratios(results, summary)
    if ratio:
        medians = ratio["of_medians"]
        print(f"\nproject / torchrun (the median of the runs' paired ratios): progress under "
              f"the trace {fmt(ratio.get('trace'))}x, clean {fmt(ratio.get('clean'))}x; the "
              f"ratio of the medians {fmt(medians.get('trace'))}x, "
              f"{fmt(medians.get('clean'))}x")  # fmt: skip
    print(json.dumps({
        "trace": {"kind": which, "rate_s": rate, "duration_s": args.duration, "seed": args.seed,
                  "nodes": shape.nodes, "ranks_per_node": shape.ranks_per_node,
                  "spares": shape.spares, "runs": args.runs, "sets": args.set,
                  "torchrun_sets": args.torchrun_set,
                  "failures": [[f.at_s, f.kind, f.target] for f in trace]},
        "systems": {s: {**summary[s], "runs": results[s]} for s in results},
        "ratio": ratio,
    }, default=str))  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--kills", action="store_true", help="SIGKILL of every rank (default)")
    kind.add_argument("--mixed", action="store_true", help="a seeded mix of failure kinds")
    p.add_argument("--rate", type=float, help="mean seconds between failures (15; mixed 30)")
    p.add_argument("--duration", type=float, default=150.0, help="seconds from the first step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=1, help="repeat; the summary takes medians")
    p.add_argument("--systems", default="project,torchrun")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a project config key, as `supervisor run --set` (repeatable)",
    )
    p.add_argument(
        "--torchrun-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a worker flag under torchrun, e.g. mem_ckpt_interval=1 (repeatable)",
    )
    p.add_argument("--no-clean", action="store_true", help="skip the clean runs (no goodput)")
    p.add_argument(
        "--startup-s",
        type=float,
        help="the project's launch -> first step, for "
        "its faults' at_s (default: its newest clean window's, else 5)",
    )
    p.add_argument("--pg-timeout", type=float, default=45.0, help="torchrun's worker flag")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="no reference run for the bit-exact check after a nan",
    )
    p.add_argument("--keep", metavar="DIR", help="keep every run's directory here")  # fmt: skip
    args = p.parse_args()
    args.systems = list(dict.fromkeys(s for s in args.systems.split(",") if s))
    if args.runs < 1:
        p.error("--runs: at least 1")
    given = [v for v in (args.duration, args.rate, args.startup_s) if v is not None]
    if not all(v > 0 for v in given):  # nan too
        p.error("--duration, --rate and --startup-s: seconds, more than 0")
    if not set(args.systems) <= {"project", "torchrun"} or not args.systems:
        p.error("--systems: project and/or torchrun")
    return args


def torchrun_flags(args) -> dict:
    flags = {**soak_project.WORKER, "pg_timeout": int(args.pg_timeout)}
    for item in args.torchrun_set:
        key, _, value = item.partition("=")
        try:
            flags[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            flags[key] = value
    return flags


def window(args, system: str, trace, shape: Shape, tmp: Path, startup: float | None) -> Outcome:
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"--- {system} {'clean' if not trace else 'trace'} ({tmp})", flush=True)
    if system == "project":
        return soak_project.run(trace, shape=shape, sets=args.set, duration_s=args.duration,
                                startup_s=startup or STARTUP_GUESS_S, tmp=tmp)  # fmt: skip
    return soak_torchrun.run(trace, shape=shape, flags=torchrun_flags(args),
                             duration_s=args.duration, tmp=tmp)  # fmt: skip


def figures(args, traced: Outcome, clean: Outcome | None, tmp: Path) -> dict:
    """One run's figures: progress, goodput, the failures' rows with their cost, exactness."""
    steps = progress(traced.records, traced.t0, args.duration)
    clean_steps = progress(clean.records, clean.t0, args.duration) if clean else None
    end = traced.t0 + args.duration
    per_step = pace(clean_steps, args.duration) or median(r["train/dt"] for r in traced.records)
    given = sorted((x for x in traced.fired if x.wall is not None), key=lambda x: x.wall)
    walls = [x.wall for x in given]
    spent: list = [None] * len(walls)
    if per_step:
        spent = interval_costs(traced.records, walls, end, per_step)
    cost = {x.fault.index: c for x, c in zip(given, spent, strict=True)}
    for row in traced.rows:
        row["cost_s"] = cost.get(row["index"])
    at = {x.fault.index: x.wall for x in given}
    ended = [(at[r["index"]], r["lost"]) for r in traced.rows
             if r.get("lost") is not None and at.get(r["index"]) is not None]  # fmt: skip
    thrown = redone(traced.records, ended, per_step) if per_step else None
    shifts = [x.wall - traced.t0 - x.fault.at_s for x in traced.fired if x.wall is not None]
    out = {
        "clean_steps": clean_steps, "trace_steps": steps, "goodput": goodput(steps, clean_steps),
        "startup_s": traced.startup_s, "clean_startup_s": clean.startup_s if clean else None,
        "ended": traced.ended or None, "clean_ended": (clean.ended or None) if clean else None,
        "given": [[x.fault.index, x.fault.kind, x.how] for x in traced.fired],
        "late_s": [round(s, 2) for s in shifts], "rows": traced.rows, "notes": traced.notes,
        "standby_cpu_s": median(traced.standby_cpu_s),
        "redone_s": thrown, "ceiling": ceiling_over(thrown, args.duration) if thrown else None,
    }  # fmt: skip
    out["exact"] = check(args, traced, clean, tmp)
    return out


def check(args, traced: Outcome, clean: Outcome | None, tmp: Path) -> dict | None:
    """Every record's loss against its reference: the clean run's; after a `nan` the worker
    run alone with the skipped positions, for the records that trained with them."""
    found: list[Numeric] = numerics(traced.skipped, traced.resumes)
    refs: dict[str, dict] = {}
    if clean is not None:
        refs["clean"] = {r["step"]: r["loss"] for r in clean.records}
    skip = skip_positions(found)
    if skip and not args.no_verify:
        upto = max(r["step"] for r in traced.records)
        refs["skipped"] = soak_reference.losses(
            traced.run_dir, traced.world, skip, upto, tmp / "reference"
        )
        if not refs["skipped"]:
            return {"note": f"not checked: the reference run made no step ({tmp / 'reference'})"}
    if not refs:
        return None
    got = exactness(traced.records, refs, found, traced.resumes).as_dict()
    names = {"clean": "the clean run", "skipped": "the worker run with --skip-batches"}
    against = " and ".join(names[k] for k in refs)
    if skip and args.no_verify:
        against += " (--no-verify: the steps trained with a skip are not checked)"
    return {**got, "against": against}


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs; per kind the medians of its failures' figures; counts."""
    rows = [r for run in runs for r in run["rows"]]
    kinds: dict[str, dict] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        kinds[kind] = {"n": len(mine), **{k: median(r.get(k) for r in mine) for k in
                       ("detection_s", "downtime_s", "lost", "cost_s")}}  # fmt: skip
    exact = [run["exact"] for run in runs if run.get("exact") and "wrong" in run["exact"]]
    return {
        "clean_steps": median(r["clean_steps"] for r in runs),
        "trace_steps": median(r["trace_steps"] for r in runs),
        "goodput": median(r["goodput"] for r in runs),
        "ceiling": median(r.get("ceiling") for r in runs),
        "by_kind": kinds,
        "relaunch": dict(Counter(r["relaunch"] for r in rows if r.get("relaunch"))),
        "source": dict(Counter(r["source"] for r in rows if r.get("source"))),
        "standby_cpu_s": median(r.get("standby_cpu_s") for r in runs),
        "steps_wrong": sum(e["wrong"] for e in exact) if exact else None,
        "steps_checked": sum(e["checked"] for e in exact) if exact else None,
    }


def ratios(results: dict[str, list[dict]], summary: dict) -> dict:
    """Project / torchrun, clean and under the trace: the median of the runs' paired ratios
    (each run's windows of the two systems ran side by side), and beside it the ratio of the
    two systems' medians."""
    if not {"project", "torchrun"} <= set(summary):
        return {}
    p, t = results["project"], results["torchrun"]
    out: dict = {"of_medians": {}}
    for k, name in (("trace_steps", "trace"), ("clean_steps", "clean")):
        runs = run_ratios([r[k] for r in p], [r[k] for r in t])
        if (paired := median(runs)) is not None:
            out[name] = round(paired, 3)
            out[f"{name}_runs"] = [None if r is None else round(r, 3) for r in runs]
        if summary["project"][k] and summary["torchrun"][k]:
            out["of_medians"][name] = round(summary["project"][k] / summary["torchrun"][k], 3)
    return out


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def show_run(system: str, i: int, f: dict) -> None:
    print(f"\n{system}, run {i}: clean {fmt(f['clean_steps'])} steps, trace "
          f"{f['trace_steps']} steps, goodput {fmt(f['goodput'], 3)}; start-up "
          f"{fmt(f['startup_s'])} s (clean {fmt(f['clean_startup_s'])} s)"
          + (f"; a standby's CPU {fmt(f['standby_cpu_s'])} s (median)"
             if f.get("standby_cpu_s") is not None else ""))  # fmt: skip
    for note in (f["ended"], f["clean_ended"], *f["notes"]):
        if note:
            print(f"  NOTE: {note}")
    print(f"  {'#':>3} {'kind':<9} {'at':>7} {'detect':>7} {'down':>7} {'lost':>5} "
          f"{'relaunch':>9} {'from':>8} {'cost':>7}")  # fmt: skip
    for r in f["rows"]:
        idx = "-" if r["index"] is None else r["index"]
        print(f"  {idx:>3} {r['kind']:<9} {r['at_s']:>6.1f}s {fmt(r.get('detection_s')):>7} "
              f"{fmt(r.get('downtime_s')):>7} {fmt(r.get('lost')):>5} "
              f"{fmt(r.get('relaunch')):>9} {fmt(r.get('source')):>8} "
              f"{fmt(r.get('cost_s')):>7}")  # fmt: skip
    if f.get("redone_s"):
        r = f["redone_s"]
        print(f"  redone: the steps in flight at the failures {r['in_flight_s']:.1f} s, the "
              f"steps lost {r['lost_s']:.1f} s; with nothing else lost, goodput "
              f"{f['ceiling']:.3f}")  # fmt: skip
    not_given = [g for g in f["given"] if g[2].startswith("not given")]
    for idx, kind, how in not_given:
        print(f"  {idx:>3} {kind:<9} {how}")
    if f["late_s"]:
        print(
            f"  given {min(f['late_s']):+.2f} to {max(f['late_s']):+.2f} s from their trace "
            "times (later: waiting for the job to train again; the project's also moved by "
            "its start-up, guessed from its newest clean window's)"
        )
    e = f["exact"]
    if e:
        if "wrong" in e:
            print(f"  bit-exact against {e['against']}: {e['wrong']} of {e['checked']} steps "
                  f"wrong{'' if not e['first_wrong'] else ' ' + str(e['first_wrong'])}, "
                  f"{e['not_checked']} not checked")  # fmt: skip
        else:
            print(f"  {e['note']}")


def show_summary(system: str, s: dict) -> None:
    print(f"\n== {system}: clean {fmt(s['clean_steps'])} steps, trace {fmt(s['trace_steps'])} "
          f"steps, goodput {fmt(s['goodput'], 3)} (medians); with nothing lost but the steps "
          f"redone, {fmt(s['ceiling'], 3)}")  # fmt: skip
    print(f"  {'kind':<9} {'n':>3} {'detect':>7} {'down':>7} {'lost':>5} {'cost':>7}")
    for kind, k in s["by_kind"].items():
        print(f"  {kind:<9} {k['n']:>3} {fmt(k['detection_s']):>7} {fmt(k['downtime_s']):>7} "
              f"{fmt(k['lost']):>5} {fmt(k['cost_s']):>7}")  # fmt: skip
    print(
        f"  relaunches: {s['relaunch'] or '–'}; resumed from: {s['source'] or '–'}; steps "
        f"wrong: {fmt(s['steps_wrong'])} of {fmt(s['steps_checked'])} checked"
        + ("" if s["standby_cpu_s"] is None else f"; a standby's CPU {fmt(s['standby_cpu_s'])} s")
    )


if __name__ == "__main__":
    main()
