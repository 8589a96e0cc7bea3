"""Fork templates with real processes: ranks forked from a node's template under the real
mpiexec compute what cold ranks compute, end as the ranks end, die with their clients, and a
client the template refuses starts its rank cold."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from contracts import template_msgs
from supervisor.launch import hosts
from tests.support import (
    TINY,
    TINY_JOB_WORKER,
    events,
    job_toml,
    losses,
    mpiexec,
    rank_env,
    read_metrics,
    run_supervisor,
    run_worker,
    wait_for_step,
)

FLAGS = [*TINY, "--device", "cpu", "--batch-size", "2"]


@pytest.fixture
def template(tmp_path):
    """A running template for a job of its own: (its process, the ranks' environment)."""
    env = rank_env(ES_JOB_ID=f"t-{secrets.token_hex(4)}", ES_HEARTBEAT_KEY=secrets.token_hex(8))
    log = open(tmp_path / "template.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.template"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    while "ready" not in (tmp_path / "template.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "the template did not start"
        time.sleep(0.05)
    yield proc, env
    proc.kill()
    proc.wait(10)
    log.close()


def client_cmd(ranks: int, *flags: str) -> list[str]:
    client = [sys.executable, "-m", "worker.template_client", "worker.train"]
    return [mpiexec(), "-n", str(ranks), *client, *FLAGS, *flags]


def rendezvous() -> dict[str, str]:
    """What the supervisor gives forked ranks, a port new for each launch: they start no MPI,
    whose finalize has Hydra end the other clients while they still stand for their ranks."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(hosts.free_port())}


def test_forked_ranks_train_as_cold_ones_and_end_as_they_end(tmp_path, template):
    proc, env = template
    cold = run_worker(2, *FLAGS, "--train-iters", "6", "--outdir", str(tmp_path / "cold"))
    assert cold.returncode == 0, cold.stderr
    forked = subprocess.run(
        client_cmd(2, "--train-iters", "6", "--outdir", str(tmp_path / "forked")),
        env={**env, **rendezvous()}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert forked.returncode == 0, forked.stderr
    assert "step 6/6" in forked.stdout  # the rank writes where the launcher reads
    want = losses(tmp_path / "cold" / "metrics-0.jsonl")
    assert losses(tmp_path / "forked" / "metrics-0.jsonl") == want
    bad = subprocess.run(
        client_cmd(2, "--train-iters", "-1"), env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--train-iters" in bad.stderr  # a usage error's exit 2


def test_a_rank_dies_with_its_client_and_a_refused_client_starts_cold(tmp_path, template):
    proc, env = template
    outdir = tmp_path / "run"
    job = subprocess.Popen(
        client_cmd(2, "--train-iters", "100000", "--outdir", str(outdir)), env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_step(outdir / "metrics-0.jsonl", 2, job)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2  # forked by the template, not started by the launcher
        clients = [
            p for p in psutil.Process(job.pid).children(recursive=True)
            if "worker.template_client" in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(clients) == 2
        clients[0].send_signal(signal.SIGKILL)
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive  # one killed with its client; the other's job ended with it
        job.wait(60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
    other_key = {**env, "ES_HEARTBEAT_KEY": "not-the-job-s"}
    cold = subprocess.run(
        client_cmd(1, "--train-iters", "2", "--outdir", str(tmp_path / "cold")),
        env=other_key, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cold.returncode == 0, cold.stderr
    assert "template refused the rank (not this job's key); starting it cold" in cold.stderr
    assert psutil.Process(proc.pid).children() == []  # it was never forked
    other = f"{env.get('GLIBC_TUNABLES', '')}:glibc.malloc.tcache_count=7"  # not the template's
    with connected(env) as sock:  # another malloc than the template's: a cold start, not a fork
        sock.sendall(request({**env, "GLIBC_TUNABLES": other}))
        sock.settimeout(30)
        answer, _ = template_msgs.receive(sock)
    assert answer["refused"].startswith(f"GLIBC_TUNABLES is {other!r} for the rank")


def request(env, **fields) -> bytes:
    """A client's request, framed; `fields` replace those of a request the template serves."""
    ask = {"module": "worker.train", "argv": ["--train-iters", "-1"], "env": env, "cwd": "/",
           "fds": [], **fields}  # fmt: skip
    return template_msgs.frame(ask)


def connected(env) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(template_msgs.socket_name(env, socket.gethostname()))
    return sock


def test_a_client_that_sends_slowly_or_never_holds_up_no_other(tmp_path, template):
    proc, env = template
    silent = [connected(env) for _ in range(3)]
    slow = connected(env)
    slow.sendall(request(env)[:3])  # a message begun, never ended
    gone = connected(env)
    gone.sendall(request(env))  # served only while its client waits for the answer
    gone.close()
    with connected(env) as sock:
        t0 = time.monotonic()
        sock.sendall(request(env, module="os"))
        sock.settimeout(30)
        answer, _ = template_msgs.receive(sock)
    assert time.monotonic() - t0 < 5.0  # not after the others' 10 s each
    assert "not one this template runs" in answer["refused"]
    time.sleep(0.5)
    log = (tmp_path / "template.log").read_text()
    assert "its client is gone" not in log  # none forked for the client that hung up
    assert "a client refused: the client is gone" in log
    for sock in [*silent, slow]:
        sock.close()


def job_env() -> dict[str, str]:
    return rank_env(ES_JOB_ID=f"t-{secrets.token_hex(4)}", ES_HEARTBEAT_KEY=secrets.token_hex(8))


def squat(name: str, uid: int) -> tuple[int, int]:
    """Another user's listener on `name` (a forked child, so no interpreter of its own): it
    writes `ready`, then how many bytes its one client sent; (its pid, the pipe to read)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(name)
            listener.listen(8)
            os.write(w, b"ready\n")
            conn, _ = listener.accept()
            conn.settimeout(20)
            got = 0
            while chunk := conn.recv(1 << 16):
                got += len(chunk)
            os.write(w, f"{got}\n".encode())
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


@pytest.mark.skipif(os.getuid() != 0, reason="listening as another user needs root")
def test_a_client_hands_nothing_to_another_users_socket():
    env = job_env()
    pid, said = squat(template_msgs.socket_name(env, socket.gethostname()), 65534)
    with os.fdopen(said) as lines:
        assert lines.readline() == "ready\n"
        client = [sys.executable, "-m", "worker.template_client", "worker.train"]
        cold = subprocess.run(
            [*client, "--train-iters", "-1"], env=env, capture_output=True, text=True, timeout=60
        )
        assert cold.returncode == 2 and "--train-iters" in cold.stderr  # started cold
        assert "another user's" in cold.stderr
        assert lines.readline() == "0\n"  # not its environment (the job's key), nor its fds
    os.waitpid(pid, 0)


def test_a_stopped_template_has_its_clients_start_cold_and_forks_for_none_of_them(
    tmp_path, template
):
    proc, env = template
    proc.send_signal(signal.SIGSTOP)
    said = tmp_path / "client.err"
    try:  # its descriptors wait in the stopped template's queue: no pipe of ours ends meanwhile
        with open(said, "w") as err:
            client = [sys.executable, "-m", "worker.template_client", "worker.train"]
            cold = subprocess.run([*client, "--train-iters", "-1"], env=env, stderr=err, timeout=30)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert cold.returncode == 2 and "--train-iters" in said.read_text()  # started cold, at once
    assert "is stopped or does not answer" in said.read_text()
    deadline = time.monotonic() + 10
    while "the client is gone" not in (tmp_path / "template.log").read_text():
        assert time.monotonic() < deadline  # continued, it reads the request and forks none
        time.sleep(0.05)
    assert psutil.Process(proc.pid).children() == []


def test_a_client_with_more_descriptors_than_it_can_hand_over_starts_its_rank_cold(
    tmp_path, template
):
    proc, env = template
    pipes = [os.pipe() for _ in range(template_msgs.MAX_FDS // 2 + 1)]
    extra = [fd for pair in pipes for fd in pair]
    client = [sys.executable, "-m", "worker.template_client", "worker.train", *FLAGS]
    job = subprocess.Popen(
        [*client, "--train-iters", "100000", "--outdir", str(tmp_path)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, pass_fds=extra,
    )  # fmt: skip
    try:
        wait_for_step(tmp_path / "metrics-0.jsonl", 1, job)
        assert psutil.Process(proc.pid).children() == []  # not one missing some of them
        assert psutil.Process(job.pid).cmdline()[1:3] == ["-m", "worker.train"]
    finally:
        job.kill()
        job.wait(30)
        for fd in extra:
            os.close(fd)


def links(pid: int) -> set[str]:
    """The sockets and pipes a process holds (`socket:[inode]`)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(("socket:", "pipe:")):
                found.add(target)
    return found


def start_forked(tmp_path, env, name: str) -> subprocess.Popen:
    """One rank's client, by hand (no launcher: a world of one), once its rank has stepped."""
    client = [sys.executable, "-m", "worker.template_client", "worker.train", *FLAGS]
    job = subprocess.Popen(
        [*client, "--train-iters", "100000", "--outdir", str(tmp_path / name)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    wait_for_step(tmp_path / name / "metrics-0.jsonl", 2, job)
    return job


def test_a_forked_rank_is_a_process_of_its_own(tmp_path, template):
    proc, env = template
    job = start_forked(tmp_path, env, "a")
    try:
        (rank,) = psutil.Process(proc.pid).children()
        assert os.getsid(rank.pid) == rank.pid  # a session of its own, as a launcher's rank has
        with open(f"/proc/{rank.pid}/comm") as comm:
            assert comm.read().strip() == "worker.train"  # ps and top tell it from the template
        assert not links(rank.pid) & links(proc.pid)  # none of the template's descriptors
    finally:
        job.kill()
        job.wait(30)


def test_a_client_ends_as_its_rank_did_sigkill_included(tmp_path, template):
    proc, env = template
    job = start_forked(tmp_path, env, "a")
    (rank,) = psutil.Process(proc.pid).children()
    rank.kill()
    assert job.wait(30) == -signal.SIGKILL  # the launcher sees what killed the rank
    job = start_forked(tmp_path, env, "b")
    proc.kill()
    assert job.wait(30) == -signal.SIGKILL  # the rank died with its template
    assert "fork template ended" in job.stdout.read()


def listening(env) -> bool:
    """Whether the job's template has bound its socket (it imports after that)."""
    name = "@" + template_msgs.socket_name(env, socket.gethostname())[1:]
    with open("/proc/net/unix") as table:
        return any(line.split()[-1] == name for line in table if len(line.split()) > 7)


def clients_of(job: subprocess.Popen) -> list[psutil.Process]:
    return [
        p for p in psutil.Process(job.pid).children(recursive=True)
        if "worker.template_client" in " ".join(p.cmdline())
    ]  # fmt: skip


def test_a_stop_that_comes_while_the_template_imports_is_a_graceful_stop(tmp_path):
    env = {**job_env(), **rendezvous()}
    outdir = tmp_path / "run"
    job = subprocess.Popen(
        client_cmd(2, "--train-iters", "300", "--outdir", str(outdir)), env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    log = open(tmp_path / "template.log", "w")  # noqa: SIM115
    template = subprocess.Popen(
        [sys.executable, "-m", "worker.template"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while not (listening(env) and len(clients_of(job)) == 2):
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.02)
        time.sleep(0.3)  # the clients connect and wait for the template's imports
        for client in clients_of(job):
            client.send_signal(signal.SIGUSR1)  # the launcher's stop, held until the fork
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        template.kill()
        template.wait(30)
        log.close()
    assert job.returncode == 0, out
    assert "stop requested: exiting after step" in out
    assert read_metrics(outdir / "metrics-0.jsonl")[-1]["step"] < 300


def test_a_job_ends_its_templates_cleanly(tmp_path):
    tables = {
        "job": {"name": "tpl", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": "mpiexec", "ranks_per_node": 2},
        "launch.env": {"OMP_NUM_THREADS": "1"},
        "worker": {**TINY_JOB_WORKER, "train_iters": 4},
        "restart": {"standby": False},
    }
    rc, out = run_supervisor(job_toml(tmp_path, tables), 180)
    assert rc == 0, out
    (ended,) = [e for e in events(tmp_path / "run") if e["event"] == "template_exit"]
    assert (ended["reason"], ended["survivors"]) == ("job over", 0)
    log = next((tmp_path / "run" / "templates").glob("output-*.log")).read_text()
    assert "SIGTERM: ending" in log and "BAD TERMINATION" not in log  # no SIGKILL at the end
    # Its ranks were forked: the template started with what the ranks read at their start (the
    # malloc tunable of [launch] huge_pages, the default), else it refuses them.
    assert "a client refused" not in log


def test_a_forked_rank_that_rejects_its_input_ends_the_job_with_exit_2(tmp_path):
    ckpt = tmp_path / "ckpt"  # another model's checkpoint: found only once the ranks said hello
    made = run_worker(1, *FLAGS, "--train-iters", "2", "--save-interval", "2",
                      "--ckpt-dir", str(ckpt), "--outdir", str(tmp_path / "made"))  # fmt: skip
    assert made.returncode == 0, made.stderr
    tables = {
        "job": {"name": "tpl", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": "mpiexec", "ranks_per_node": 2},
        "launch.env": {"OMP_NUM_THREADS": "1"},
        "worker": {**TINY_JOB_WORKER, "dim": 64, "train_iters": 4, "ckpt_dir": str(ckpt)},
        "restart": {"standby": False},
    }
    rc, out = run_supervisor(job_toml(tmp_path, tables), 180)
    assert rc == 2, out  # bad input, as with cold ranks: not a failure relaunched in vain
    assert "is of another model" in out
    assert sum(e["event"] == "launch" for e in events(tmp_path / "run")) == 1
