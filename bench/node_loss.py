"""What a lost node costs with partner copies, against a process crash in the same job (issue 27).

One invocation, three jobs under `python -m supervisor run` on emulated nodes (real mpiexec,
real SIGKILLs, real sockets), the demo config at the `debug` preset's own sizes (batch 1), 4
nodes x 1 rank, a memory copy every step, a durable save every 20 steps:

  without  partner copies off, no fault: the uninterrupted run, and the step time without
  with     partner copies on, no fault: the step time with them (`--pairs` of these two, in
           turn: on a shared host the step time moves by 10% from one job to the next)
  faults   partner copies on, 1 spare: a process crash (SIGKILL of rank 1) at step 12, then a
           `node_loss` of node 1 at step 32 (its memory root removed, the spare in its place)

Per failure, from the events and rank 0's metrics:
  lost     steps lost (the report's figure)
  from     where the resume came from (`resumed` event's `source`)
  cost     kill -> rank 0's first step past the newest step done before the kill
Then: durable reads after the node loss (0 wanted), bit-exact losses against the plain run,
the node loss's cost over the crash's (<= 2 wanted), the step time with partner copies over
without (the median of the `with` jobs' steps past their first 3 over the same of the `without`
jobs; <= 1.05 wanted; with rank 0's copies sent and skipped), the bytes/s rank 0 handed to the
network against a loopback floor (a ZeroMQ PUSH/PULL of the same bytes in this process, best of
5), and 100 damaged partner copies (one bit flipped in a real held copy's header fields, tensor
bytes or record; copied out of the job's
memory while it ran) of which none may pass the checks a fetch makes. The last line is JSON.

With `--standby on` every job trains 80 steps, the crash comes at step 25 and the node loss at
step 70 (the standby ready at the crash; the next standby, then the prepared ranks of
[restart] warm_spare at the loss); each failure's row says its relaunch's `mode` (warm,
prepared or cold).

With `--testbed` every job runs on real hosts of the test bed (`testbed/`, root: each node
its own hostname, address and /dev/shm, Hydra over `testbed/ssh`; the supervisor on this
machine): 3 hosts x 1 rank and, for the failures, 1 spare host, standby on; the crash is the
same fault, and the node loss is `testbed kill n1` (every process of the host at once, its
/dev/shm gone) once rank 0 is past the step, found by the job itself.

With `--testbed --launcher srun` the bed runs a Slurm cluster too (`testbed up 4 --slurm`) and
every job is `salloc --no-kill -N <its hosts> python -m supervisor run`, launched by srun with
`nodes = "auto"`.

Usage: python bench/node_loss.py [--standby off|on] [--pairs 3] [--testbed [--launcher srun]]
       [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Rank 0's metrics of an attempt, beside this script (a script's folder is on sys.path).
from downtime_figures import records  # noqa: E402

from supervisor.log.events import read_events  # noqa: E402
from supervisor.reporting.analysis import analyze  # noqa: E402
from supervisor.reporting.load import load_run  # noqa: E402
from supervisor.settings import toml_dump  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len")
TRAIN_ITERS = 45
CRASH = {"name": "crash", "at_step": 12, "action": "kill", "target": "rank:1"}
LOSS = {"name": "lose-node1", "at_step": 32, "action": "node_loss", "target": "node:1"}
# With the standby: later, so that the standby is ready at the crash and, after it, the next
# standby and then the prepared ranks (imports on 5 nodes) at the node loss.
STANDBY_STEPS = {"train_iters": 80, "crash": 25, "loss": 70}
SNAPSHOT_AT = 25  # step at which a held partner copy is copied out for the damage trials
SKIP_AFTER_START = 3  # steps of each attempt left out of the steady step
TRIALS = 100
PAIR = (("without", False), ("with", True))


def config(
    out: Path, run: Path, mem: Path, *, partner: bool, faults: bool, standby: bool,
    bed=None, launcher: str = "mpiexec",
):  # fmt: skip
    """The job's config; with `bed` (a testbed.Bed), on its hosts: the node loss is the bed's."""
    raw = tomllib.loads((ROOT / "configs" / "debug.toml").read_text())
    worker = {k: v for k, v in raw["worker"].items() if k not in SIZE_KEYS}
    steps = STANDBY_STEPS if standby else {"train_iters": TRAIN_ITERS, "crash": 12, "loss": 32}
    worker.update(
        model="debug", batch_size=1, train_iters=steps["train_iters"], save_interval=20,
        mem_ckpt_interval=1, mem_partner="on" if partner else "off",
    )  # fmt: skip
    nodes = [f"n{i}" for i in range(5 if faults else 4)]
    raw.update(
        job={"name": "nodeloss", "run_dir": str(run)},
        launch={
            "launcher": "mpiexec", "emulate_nodes": True, "ranks_per_node": 1, "nodes": nodes,
            "spares": 1 if faults else 0,
            "env": {"OMP_NUM_THREADS": "1", "ES_MEM_ROOT": str(mem)},
        },
        worker=worker,
        faults=[{**CRASH, "at_step": steps["crash"]}, {**LOSS, "at_step": steps["loss"]}]
        if faults else [],
    )  # fmt: skip
    raw["restart"] = {**raw.get("restart", {}), "standby": standby, "backoff_s": [0]}
    raw["restart"]["exclude_after"] = 2
    if bed is not None and launcher == "srun":  # the allocation's nodes (salloc -N)
        raw["launch"] = {
            "launcher": "srun", "nodes": "auto", "ranks_per_node": 1,
            "spares": 1 if faults else 0, "args": ["--mpi=none"],
            "env": {"OMP_NUM_THREADS": "1"},
        }  # fmt: skip
    elif bed is not None:  # 3 hosts (+ the spare); the loss is `testbed kill`, not a fault
        raw["launch"] = {
            "launcher": "mpiexec", "flavor": "hydra", "ranks_per_node": 1,
            "nodes": bed.hosts[: 4 if faults else 3], "spares": 1 if faults else 0,
            "args": bed.launcher_args(), "env": {"OMP_NUM_THREADS": "1"},
        }  # fmt: skip
    if bed is not None:
        raw["faults"] = [f for f in raw["faults"] if f["action"] != "node_loss"]
        raw["launch"]["env"]["TMPDIR"] = "/var/tmp/es-testbed-local"  # each host's own scratch
    out.write_text(toml_dump.dumps(raw))
    return out


def metrics(run: Path) -> dict[int, list[dict]]:
    """Rank 0's records per attempt (read while the job runs: a torn last line is skipped)."""
    if not (run / "attempts").is_dir():
        return {}  # the job has not launched yet
    attempts = sorted(int(adir.name) for adir in (run / "attempts").iterdir())
    return {a: recs for a in attempts if (recs := records(run, a))}


def run_job(
    cfg: Path, run: Path, mem: Path, snapshot: Path | None, bed=None, loss_at: int | None = None
) -> float | None:
    """The job to its end; with `snapshot`, the partner copies node n2 holds are copied there
    once rank 0 is past SNAPSHOT_AT (while the job runs: they are gone at its end). On the bed
    with `loss_at`: host n1 killed once rank 0 is past that step; its time is returned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "supervisor", "run", str(cfg)]
    if bed is not None and bed.slurm:  # inside an allocation of every host, as a batch job
        cmd = ["salloc", "--no-kill", f"--nodes={len(bed.hosts) - (0 if loss_at else 1)}",
               "--quiet", *cmd]  # fmt: skip
        env.update(bed.slurm_env())
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    taken, killed = snapshot is None, None
    while proc.poll() is None:
        steps = [r["step"] for recs in metrics(run).values() for r in recs] if run.exists() else []
        if not taken and steps and max(steps) >= SNAPSHOT_AT:
            taken = take_snapshot(mem, snapshot, bed)
        if bed is not None and loss_at and killed is None and steps and max(steps) >= loss_at:
            killed = time.time()
            bed.kill("n1")
        time.sleep(0.2)
    out = proc.stdout.read()
    if bed is not None and killed is not None:
        bed.heal("n1")
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{out[-3000:]}")
    print(out[out.find("== nodeloss") :].strip(), flush=True)
    return killed


def take_snapshot(mem: Path, snapshot: Path, bed) -> bool:
    """Copy the partner copies node n2 holds (on the bed: from that host's own /dev/shm)."""
    if bed is None:
        held = list(mem.glob("n2/es-mem-*/partner"))
        if held:
            shutil.copytree(held[0], snapshot)
        return bool(held)
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    copy = 'd=$(ls -d /dev/shm/es-mem-*/partner | head -1) && [ -n "$d" ] && cp -r "$d" "$0"'
    return bed.exec("n2", ["sh", "-c", copy, str(snapshot)], timeout=60).returncode == 0


def failures(run: Path, killed_at: float | None = None) -> list[dict]:
    """Per fault (and the bed's `kill n1` at `killed_at`, as a `node_loss`): its figures."""
    evs = list(read_events(run / "events.jsonl"))
    recs = metrics(run)
    lost = {f.attempt: f.lost_steps for f in analyze(load_run(run)).failures}
    faults = [e for e in evs if e["event"] == "fault"]
    if killed_at is not None:  # the attempt running then, and rank 0's step when it died
        running = [e for e in evs if e["event"] in ("launch", "relaunch") and e["ts"] <= killed_at]
        attempt = running[-1]["attempt"]
        step = max((r["step"] for r in recs.get(attempt, []) if r["t"] <= killed_at), default=0)
        faults.append({"name": "kill-host-n1", "action": "node_loss", "step": step,
                       "attempt": attempt, "ts": killed_at})  # fmt: skip
    out = []
    for fault in faults:
        before = fault["step"]
        after = [r for a, rs in recs.items() if a > fault["attempt"] for r in rs]
        past = next((r for r in after if r["step"] > before), None)
        resumed = [e for e in evs if e["event"] == "resumed" and e["attempt"] > fault["attempt"]]
        relaunch = [e for e in evs if e["event"] == "relaunch" and e["after"] == fault["attempt"]]
        out.append({
            "name": fault["name"], "action": fault["action"], "before": before,
            "lost": lost.get(fault["attempt"]),
            "from": resumed[0].get("source") if resumed else None,
            "resumed": resumed[0]["step"] if resumed else None,
            "cost_s": round(past["t"] - fault["ts"], 3) if past else None,
            "mode": relaunch[0]["mode"] if relaunch else None,
        })  # fmt: skip
    return out


def steady_step(run: Path) -> float:
    """Median dt of rank 0's steps past its first SKIP_AFTER_START (a job without faults)."""
    return statistics.median(
        r["train/dt"] for recs in metrics(run).values() for r in recs[SKIP_AFTER_START:]
    )


def losses(run: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for recs in metrics(run).values():
        for r in recs:
            out[r["step"]] = r["loss"]
    return out


def partner_rate(run: Path) -> tuple[float | None, int]:
    """Bytes/s rank 0 handed to the network, and the bytes of one copy."""
    nbytes = seconds = sent = 0.0
    for recs in metrics(run).values():
        for r in recs:
            nbytes += r.get("train/mem_partner_nbytes", 0)
            seconds += r.get("train/mem_partner_seconds", 0)
            sent += r.get("train/mem_partner_sent", 0)
    return (nbytes / seconds if seconds else None), int(nbytes / sent) if sent else 0


def partner_counts(runs: list[Path]) -> dict[str, int]:
    """Rank 0's copies sent, skipped (its partner still busy with the one before), received
    and refused, over `runs`: a copy skipped costs no step time, so the ratio means little
    without them."""
    names = ("sent", "skipped", "received", "refused")
    return {
        n: int(sum(r.get(f"train/mem_partner_{n}", 0) for run in runs
                   for recs in metrics(run).values() for r in recs))
        for n in names
    }  # fmt: skip


def loopback_floor(nbytes: int) -> float:
    """Bytes/s of one copy's bytes over a ZeroMQ PUSH/PULL on loopback in this process."""
    import zmq

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    data = bytearray(os.urandom(1024)) * (nbytes // 1024 + 1)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        push.send(memoryview(data)[:nbytes], copy=False)
        pull.recv(copy=False)
        best = min(best, time.perf_counter() - t0)
    push.close(0)
    pull.close(0)
    return nbytes / best


def damage_trials(snapshot: Path) -> tuple[int, int]:
    """(trials, copies that passed the fetch's checks) over TRIALS single-bit flips of a real
    held copy of rank 1's state."""
    import torch

    from worker.ckpt.memory import find_held
    from worker.ckpt.memory.partner_copy import bytes_problem, header_problem, ward_expect

    job_dir = snapshot.parent
    (rank_dir,) = snapshot.glob("rank-1")
    some = json.loads(next(rank_dir.glob("slot-*.json")).read_text())
    keys = ("job", "rank", "world", "mesh", "model_fingerprint", "host")
    from worker.ckpt.memory import Expect

    expect = replace(Expect(**{k: some[k] for k in keys}), rank=2)
    (held, *_) = find_held(job_dir, expect)[1]
    bin_path, json_path = held.path, held.path.with_suffix(".json")
    good = bin_path.read_bytes(), json_path.read_bytes()
    tensors = [(e["offset"], e["nbytes"]) for e in held.record["table"].values() if "offset" in e]
    rng, passed = random.Random(27), 0
    for _ in range(TRIALS):
        which = rng.choice(["header", "tensor", "record"])
        path, original = (json_path, good[1]) if which == "record" else (bin_path, good[0])
        damaged = bytearray(original)
        if which == "header":
            at = rng.randrange(32)
        elif which == "tensor":
            offset, size = rng.choice(tensors)
            at = 4096 + offset + rng.randrange(size)
        else:
            at = rng.randrange(len(damaged))
        damaged[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            for h in find_held(job_dir, expect).get(1, []):
                if h.step != held.step:
                    continue
                data = torch.frombuffer(bytearray(h.path.read_bytes()[4096:]), dtype=torch.uint8)
                problem = header_problem(h.record, ward_expect(expect, 1), data.numel())
                if problem is None and bytes_problem(h.record["table"], data) is None:
                    passed += 1
        finally:
            path.write_bytes(original)
    return TRIALS, passed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--standby", choices=("off", "on"), default="off")
    ap.add_argument("--pairs", type=int, default=3, help="jobs without and with, in turn")
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    ap.add_argument("--testbed", action="store_true", help="on real hosts of the test bed")
    ap.add_argument(
        "--launcher",
        choices=("mpiexec", "srun"),
        default="mpiexec",
        help="with --testbed: Hydra over ssh, or srun on the bed's Slurm cluster",
    )
    args = ap.parse_args()
    if args.launcher != "mpiexec" and not args.testbed:
        ap.error("--launcher srun needs --testbed (its Slurm cluster)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-nodeloss-"))
    bed = None
    if args.testbed:
        import testbed

        why = testbed.available()
        if why:
            raise SystemExit(f"--testbed: {why}")
        testbed.down()
        bed = testbed.up(4, slurm_cluster=args.launcher == "srun")
    killed_at = None
    try:
        runs = {}
        pairs = [(f"{n}{i}", p, False) for i in range(args.pairs) for n, p in PAIR]
        for name, partner, faults in [*pairs, ("faults", True, True)]:
            run, mem = (
                tmp / name / "run",
                Path(tempfile.mkdtemp(prefix="es-bench-", dir="/dev/shm")),
            )
            standby = args.standby == "on" or bed is not None
            cfg = config(tmp / f"{name}.toml", run, mem, partner=partner, faults=faults,
                         standby=standby, bed=bed, launcher=args.launcher)  # fmt: skip
            print(f"--- {name}: partner copies {'on' if partner else 'off'}", flush=True)
            snapshot = tmp / "snapshot" / "partner" if faults else None
            loss_at = (STANDBY_STEPS["loss"] if standby else 32) if faults else None
            at = run_job(cfg, run, mem, snapshot, bed, loss_at)
            killed_at = at if faults else killed_at
            shutil.rmtree(mem, ignore_errors=True)
            runs[name] = run
        rows = failures(runs["faults"], killed_at)
        for r in rows:
            where = f"resumed {r['resumed']} ({r['from']})"
            print(f"{r['name']:<12} {r['action']:<10} before {r['before']:>3}  {where}  "
                  f"lost {r['lost']}  cost {r['cost_s']} s  {r['mode']}")  # fmt: skip
        crash = next(r for r in rows if r["action"] == "kill")
        node = next(r for r in rows if r["action"] == "node_loss")
        each = {n: [steady_step(runs[f"{n}{i}"]) for i in range(args.pairs)] for n, _ in PAIR}
        with_p, without = statistics.median(each["with"]), statistics.median(each["without"])
        want, got = losses(runs["without0"]), losses(runs["faults"])
        if any(losses(runs[name]) != want for name, _, _ in pairs):
            print("WARNING: a run without faults differs from the first")
        rate, nbytes = partner_rate(runs["with0"])
        floor = loopback_floor(nbytes) if nbytes else None
        trials, passed = damage_trials(tmp / "snapshot" / "partner")
        result = {
            "testbed": bool(bed),
            "launcher": args.launcher if bed else "mpiexec",
            "standby": "on" if bed is not None else args.standby,
            "node_loss": {
                "lost": node["lost"], "from": node["from"],
                "durable_reads": sum(r["from"] == "durable" for r in rows if r is node),
                "cost_s": node["cost_s"], "mode": node["mode"],
            },
            "crash": {"lost": crash["lost"], "from": crash["from"], "cost_s": crash["cost_s"],
                      "mode": crash["mode"]},
            "node_over_crash": round(node["cost_s"] / crash["cost_s"], 2)
            if node["cost_s"] and crash["cost_s"] else None,
            "bit_exact": got == want,
            "step_s": {"partner": round(with_p, 4), "none": round(without, 4),
                       "ratio": round(with_p / without, 3),
                       "each": {n: [round(x, 4) for x in v] for n, v in each.items()}},
            "partner_copies": partner_counts([runs[f"with{i}"] for i in range(args.pairs)]),
            "partner_bytes_per_s": round(rate) if rate else None,
            "copy_bytes": nbytes,
            "loopback_floor_bytes_per_s": round(floor) if floor else None,
            "damaged": {"trials": trials, "loaded": passed},
        }  # fmt: skip
        print(json.dumps(result))
    finally:
        if bed is not None:
            import testbed

            testbed.down()
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
