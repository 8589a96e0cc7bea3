"""Shared test helpers (imported as `tests.support`): launch the real worker under the real
mpiexec and read what it wrote; the hand-made run dirs, checkpoints and beacon environment that a
unit test and its process twin in e2e/ both use."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from contracts import ckpt_files as ckpt_files
from contracts import env_names, inject
from supervisor.commands import cli
from supervisor.log.events import read_events

REPO = Path(__file__).resolve().parents[1]

# The one tiny model of the end-to-end tests: a 4-rank job on 2 cores takes seconds.
TINY_SIZES = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
              "vocab_size": 128, "seq_len": 32}  # fmt: skip
TINY = [x for k, v in TINY_SIZES.items() for x in (f"--{k.replace('_', '-')}", str(v))]
# The one schedule of the tests that compare losses with the uninterrupted run (its reference
# is computed once per test run: the `reference` fixture).
ITERS = 24
LAUNCH_TIMEOUT = 180

# The worker layouts the end-to-end tests run: name -> (ranks, flags).
LAYOUTS = {
    "fsdp2": (2, []),
    "hsdp2x2": (4, ["--replicate", "2"]),
    "fsdp_tp2": (4, ["--tp", "2"]),
}


def tiered(values, default) -> list:
    """Parameters of which only `default` runs in the default tier, the rest in the slow one
    (`python -m pytest -m slow`): each capability once by default, its matrix when asked."""
    slow = [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values if v != default]  # fmt: skip
    return [default, *slow]


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if not found:
        pytest.skip("mpiexec not found")
    return found


def inject_env(**points) -> dict[str, str]:
    """The environment that arms these test-only failure points (contracts.inject) in a job's
    ranks and its pre-launch node check: `inject_env(rank=1, raise_at_step=3)`."""
    return {env_names.ENV_INJECT: inject.spec(**points)}


def rank_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def worker_cmd(ranks: int, *flags: str) -> list[str]:
    return [mpiexec(), "-n", str(ranks), sys.executable, "-m", "worker.train", *flags]


def run_worker(
    ranks: int, *flags: str, timeout: float = LAUNCH_TIMEOUT, env: dict | None = None, **kw
):
    return subprocess.run(
        worker_cmd(ranks, *flags),
        env=env or rank_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def start_worker(ranks: int, *flags: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        worker_cmd(ranks, *flags),
        env=env or rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(path: Path) -> dict[int, float]:
    """step -> loss; a later record of the same step (after a resume) replaces the earlier."""
    return {r["step"]: r["loss"] for r in read_metrics(path)}


def assert_same_losses(want: dict[int, float], metrics: Path) -> None:
    """Every record of an interrupted run, recomputed steps included, equals the uninterrupted
    run's loss bit for bit, and every step of that run is there."""
    got = read_metrics(metrics)
    assert {r["step"] for r in got} == set(want)
    for r in got:
        assert r["loss"] == want[r["step"]], (r["step"], r["loss"], want[r["step"]])


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """The newest step a worker run by hand has logged, once it is at least `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_metrics(metrics)
        if records and records[-1]["step"] >= step:
            return records[-1]["step"]
        if proc.poll() is not None:
            raise AssertionError(f"job ended early: {proc.stdout.read()}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def kill_every_rank(proc: subprocess.Popen) -> None:
    """The study's kill: SIGKILL to every training rank at once; the launcher then tears down."""
    ranks = psutil.Process(proc.pid).children(recursive=True)
    for p in ranks:
        if "worker.train" in " ".join(p.cmdline()):
            p.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    psutil.wait_procs(ranks, timeout=30)


def toml_value(v) -> str:
    """A Python value as TOML, for the configs the supervisor tests write."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(i) for i in v) + "]"
    return str(v)


def toml_table(header: str, items: dict) -> str:
    """One TOML table of a job config the supervisor tests write."""
    return f"{header}\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in items.items()) + "\n"


# The worker table of a tiny supervised job: the same model (2 ranks on 2 cores, seconds per
# attempt).
TINY_JOB_WORKER = {"model": "debug", "device": "cpu", **TINY_SIZES, "batch_size": 2}


def worker_flags(table: dict) -> list[str]:
    """A job config's [worker] table as the worker's command-line flags."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in table.items()]


def supervisor_env() -> dict[str, str]:
    """The environment a test's `supervisor run` gets: this venv's mpiexec, no job's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    return env


def start_supervisor(
    config: Path, *args: str, extra_env: dict[str, str] | None = None, **popen
) -> subprocess.Popen:
    """`supervisor run CONFIG ARGS`; its output piped unless `popen` says otherwise."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **popen}
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", str(config), *args],
        cwd=REPO, env={**supervisor_env(), **(extra_env or {})}, text=True, **popen,
    )  # fmt: skip


def finish_supervisor(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Its exit status and output; the test fails if it runs past `timeout`."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"supervisor did not finish in {timeout} s:\n{(out or '')[-4000:]}")
    return proc.returncode, out or ""


def run_supervisor(config: Path, timeout: float, *args: str) -> tuple[int, str]:
    return finish_supervisor(start_supervisor(config, *args), timeout)


def supervisor_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m supervisor ARGS` (tail, status, report, ...) as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args], cwd=REPO, env=supervisor_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def events(run: Path) -> list[dict]:
    """A run's events.jsonl; a line still being written is skipped."""
    return list(read_events(run / "events.jsonl"))


def wait_for(run: Path, pred, proc: subprocess.Popen, timeout: float = 90) -> dict:
    """The first event of a running job that `pred` accepts; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(run):
            if pred(e):
                return e
        if proc.poll() is not None:
            pytest.fail(f"supervisor exited ({proc.returncode}) before the awaited event")
        time.sleep(0.05)
    pytest.fail("timed out waiting for an event")


def names(evs: list[dict]) -> list[str]:
    return [e["event"] for e in evs]


def rank_pid(run: Path, rank: int, attempt: int) -> int:
    return next(
        e["pid"] for e in events(run)
        if e["event"] == "rank_hello" and e["rank"] == rank and e["attempt"] == attempt
    )  # fmt: skip


def assert_in_order(evs: list[str], expected: list[str]) -> None:
    it = iter(evs)
    missing = [name for name in expected if name not in it]
    assert not missing, f"{expected} not in order in {evs}"


# --- hand-made inputs -----------------------------------------------------------------------------
def job_toml(tmp_path: Path, tables: dict[str, dict], faults=()) -> Path:
    """A job config from its tables ({"job": {...}, "heartbeat.progress": {...}}) and faults."""
    text = "".join(toml_table(f"[{name}]", items) for name, items in tables.items())
    text += "".join(toml_table("[[faults]]", f) for f in faults)
    return write_job_toml(tmp_path, text)


def one_line_error(capsys, argv: list[str]) -> str:
    """A user error of `python -m supervisor ARGV` run here: exit 2 and one line, no traceback."""
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def write_job_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def validate(capsys, *argv: str) -> tuple[int, str]:
    """`validate ARGV` in this process: its exit code and all it printed."""
    rc = cli.main(["validate", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def fake_checkpoints(root: Path, steps=(5, 10)) -> None:
    for step in steps:
        d = ckpt_files.step_dir(root, step)
        d.mkdir(parents=True)
        for r in (0, 1):
            (d / f"__{r}_0.distcp").write_bytes(bytes(range(256)) * 4)
        ckpt_files.mark_complete(d, {"step": step, "files": ckpt_files.record_files(d)})


BEACON_KEY = "s3cret" * 8  # the heartbeat tests' HMAC key and job id
BEACON_JOB = "job-1"


def beacon_env(monkeypatch, addr, attempt=0, interval=0.1):
    monkeypatch.setenv(env_names.ENV_HEARTBEAT_ADDR, addr)
    monkeypatch.setenv(env_names.ENV_HEARTBEAT_KEY, BEACON_KEY)
    monkeypatch.setenv(env_names.ENV_JOB_ID, BEACON_JOB)
    monkeypatch.setenv(env_names.ENV_ATTEMPT, str(attempt))
    monkeypatch.setenv(env_names.ENV_HEARTBEAT_INTERVAL, str(interval))
    monkeypatch.delenv(env_names.ENV_EXIT_WITH_PARENT, raising=False)


def make_run(tmp_path: Path, *, finished: bool) -> Path:
    run = tmp_path / "run"
    (run / "ckpt" / "step-20").mkdir(parents=True)
    (run / "ckpt" / "step-20" / ".complete").write_text("")
    (run / "ckpt" / "step-30").mkdir()  # not complete
    (run / "config.toml").write_text(
        f'[job]\nname = "demo"\n[restart]\nmax_restarts = 4\n[worker]\nckpt_dir = "{run}/ckpt"\n'
    )
    evs = [
        {"event": "start", "pid": 999_999_999, "ts": 1.0, "mono": 1.0},
        {"event": "launch", "attempt": 0, "ts": 2.0, "mono": 2.0},
        {"event": "progress", "attempt": 0, "step": 23, "ts": 3.0, "mono": 3.0},
        {"event": "attempt_end", "attempt": 0, "outcome": "failure", "detail": "exit 9",
         "detected_by": "exit", "resume_step": 0, "max_step": 23, "ts": 4.0, "mono": 4.0},
        {"event": "relaunch", "attempt": 1, "ts": 5.0, "mono": 5.0},
        {"event": "launch", "attempt": 1, "ts": 6.0, "mono": 6.0},
    ]  # fmt: skip
    if finished:
        evs.append({"event": "supervisor_exit", "code": 0, "code_name": "DONE",
                    "reason": "the worker finished", "ts": 9.0, "mono": 9.0})  # fmt: skip
    text = "".join(json.dumps(e) + "\n" for e in evs)
    (run / "events.jsonl").write_text(text + '{"torn li')  # a crash mid-write
    return run


# --- a hand-made run with known answers (the report tests) --------------------------------------
T0 = 1000.0  # the synthetic run's start; ts = T0 + mono


def ev(event: str, mono: float, **facts) -> dict:
    return {"event": event, "ts": T0 + mono, "mono": mono, **facts}


def rec(step: int, t: float, **extra) -> dict:
    return {"step": step, "t": t, "loss": 5.0, "train/dt": 0.5, "train/tps": 100.0, **extra}


def write_run(root: Path, events: list[dict], metrics: dict[int, list], config: str = "") -> Path:
    root.mkdir(parents=True)
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for attempt, lines in metrics.items():
        d = root / "attempts" / f"{attempt:03d}"
        d.mkdir(parents=True)
        text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
        (d / "metrics-0.jsonl").write_text(text)
    (root / "config.toml").write_text(
        config or '[job]\nname = "syn"\n\n[worker]\nsave_interval = 10\n'
    )
    return root


def synthetic_events() -> list[dict]:
    """Attempt 0 killed by a fault at step 25 (resumes from 20); attempt 1 hangs after step 40
    (no fault: a natural failure; resumes from 40); attempt 2 finishes at step 50."""
    return [
        ev("start", 0.0, world=2),
        ev("launch", 0.0, attempt=0),
        ev("first_step", 10.0, attempt=0, step=1),
        ev("phase", 19.1, attempt=0, phase="save", step=10),
        ev("ckpt_complete", 19.4, attempt=0, step=10),
        ev("phase", 29.1, attempt=0, phase="save", step=20),
        ev("ckpt_complete", 29.8, attempt=0, step=20),
        ev("fault", 35.5, attempt=0, name="k", action="kill", target="all", step=25),
        ev("exit", 35.6, attempt=0, returncode=137, exit_mono=35.6),
        ev("teardown", 35.7, attempt=0, reason="exit", start_mono=35.7, latency_s=0.1),
        ev("attempt_end", 35.9, attempt=0, outcome="failure", detail="exit 137",
           detected_by="exit", resume_step=0, max_step=25),
        ev("relaunch", 35.9, attempt=1, after=0),
        ev("launch", 36.0, attempt=1),
        ev("resumed", 45.0, attempt=1, step=20, restart_seconds=8.0),
        ev("first_step", 45.0, attempt=1, step=21),
        ev("phase", 54.1, attempt=1, phase="save", step=30),
        ev("ckpt_complete", 54.5, attempt=1, step=30),
        ev("phase", 64.05, attempt=1, phase="save", step=40),
        ev("ckpt_complete", 64.5, attempt=1, step=40),
        ev("hang", 70.0, attempt=1, ranks=[1], detected_mono=70.0, latency_s=0.05),
        ev("teardown", 70.1, attempt=1, reason="hang", start_mono=70.1, latency_s=0.1),
        ev("attempt_end", 70.5, attempt=1, outcome="failure", detail="hang: rank 1",
           detected_by="hang", resume_step=20, max_step=40),
        ev("relaunch", 70.5, attempt=2, after=1),
        ev("launch", 71.0, attempt=2),
        ev("resumed", 80.0, attempt=2, step=40, restart_seconds=7.0),
        ev("first_step", 80.0, attempt=2, step=41),
        ev("attempt_end", 89.5, attempt=2, outcome="success", detected_by="exit", max_step=50),
        ev("done", 89.5, attempt=2, step=50),
        ev("supervisor_exit", 90.0, code=0, code_name="DONE"),
    ]  # fmt: skip


def synthetic_metrics() -> dict[int, list]:
    a0 = [rec(k, T0 + 9 + k) for k in range(1, 26)]
    a0[10]["train/ckpt_save_seconds"] = 0.4  # step 11: the save at 10
    a0[20]["train/ckpt_save_seconds"] = 0.6  # step 21: the save at 20
    a1 = [rec(k, T0 + 45 + (k - 21)) for k in range(21, 41)]
    a1[0]["train/restart_seconds"] = 8.0
    a1[10]["train/ckpt_save_seconds"] = 0.5  # step 31: the save at 30
    a1.insert(3, '{"step": 24, "t": 10')  # a torn line
    a1.insert(5, '{"step": "x", "t": 1.0}')  # a malformed one
    a2 = [rec(k, T0 + 80 + (k - 41)) for k in range(41, 51)]
    return {0: a0, 1: a1, 2: a2}
