"""The test bed (`testbed/`) with real processes: hosts of their own (hostname, address, /dev/shm,
node-local scratch), names that resolve everywhere, MPICH Hydra starting a rank in each host
through `testbed/ssh`, TCP between hosts and to the machine, `kill`, `cut`, `heal`, and a
`down` that leaves nothing behind (also after whoever ran `up` is gone). Needs root: skips with
`testbed.available()`'s reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import testbed
from testbed import network, procs
from testbed.layout import BRIDGE, HOSTS_FILE, NETNS_PREFIX
from tests.support import REPO, mpiexec, rank_env
from tests.testbed_support import bed_fixture, bed_module_fixture  # noqa: F401 (fixtures)

TESTBED_HOSTS = 2
T = 30  # seconds: the bound of every wait here


def out(bed: testbed.Bed, host: str, *argv: str) -> str:
    done = bed.exec(host, list(argv), capture_output=True, text=True, timeout=T)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def ssh(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(testbed.LAUNCHER), *argv], capture_output=True, text=True,
                          timeout=T, **kw)  # fmt: skip


def alive(pid: int) -> bool:
    return not procs.is_zombie(pid)


def test_hosts_have_their_own_hostname_address_shm_and_scratch(bed, tmp_path):
    assert bed.hosts == ["n0", "n1"]
    for h in bed.hosts:
        assert out(bed, h, "hostname") == h
        assert f"inet {bed.address(h)}/24" in out(bed, h, "ip", "-4", "-o", "addr", "show", "eth0")
        assert out(bed, h, "pwd") == os.getcwd()  # the caller's directory: the fs is shared
        assert "default" not in out(bed, h, "ip", "route")  # the bed's hosts and the head only
    name = f"estb-{uuid.uuid4().hex}"
    for d in ("/dev/shm", str(testbed.SCRATCH)):
        out(bed, "n0", "sh", "-c", f"echo x > {d}/{name}")
        assert name in out(bed, "n0", "ls", d).split()
        assert name not in out(bed, "n1", "ls", d).split()
        assert not Path(d, name).exists()  # nor the machine's
    out(bed, "n1", "sh", "-c", f"echo shared > {tmp_path}/f")
    assert (tmp_path / "f").read_text() == "shared\n"


def test_names_resolve_everywhere(bed):
    head = socket.gethostname()
    for h in bed.hosts:
        assert socket.gethostbyname(h) == bed.address(h)  # the machine (head node)
        for peer in bed.hosts:
            assert out(bed, h, "getent", "hosts", peer).split() == [bed.address(peer), peer]
        assert out(bed, h, "getent", "hosts", head).split() == [testbed.HEAD_ADDRESS, head]


CONNECT = """import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
c.sendall(socket.gethostname().encode())"""


def test_tcp_host_to_host_and_host_to_machine(bed):
    with socket.socket() as s:  # the machine listens on the bridge; n0 calls it by name
        s.bind((testbed.HEAD_ADDRESS, 0))
        s.listen()
        s.settimeout(T)
        port = str(s.getsockname()[1])
        client = bed.popen("n0", [sys.executable, "-c", CONNECT, socket.gethostname(), port, "5"])
        conn, (addr, _) = s.accept()
        assert (conn.recv(16), addr) == (b"n0", bed.address("n0"))
        conn.close()
        assert client.wait(timeout=T) == 0
    listen = ("import socket; s = socket.create_server(('n1', 0)); s.settimeout(30);"
              "print(s.getsockname()[1], flush=True); c, a = s.accept(); print(c.recv(16).decode(),"
              " a[0])")  # fmt: skip
    server = bed.popen("n1", [sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
    port = server.stdout.readline().strip()
    out(bed, "n0", sys.executable, "-c", CONNECT, "n1", port, "5")
    assert server.communicate(timeout=T)[0].split() == ["n0", bed.address("n0")]


def test_hydra_starts_a_rank_in_each_host(bed):
    cmd = [mpiexec(), *bed.launcher_args(), "-hosts", "n0,n1", "-n", "2", "hostname"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=T, env=rank_env())
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["n0", "n1"]


EXCHANGE = """import os, socket, time
rank = int(os.environ["PMI_RANK"])
if rank == 0:
    s = socket.create_server(("n0", int(os.environ["PORT"])))
    s.settimeout(30)
    c, a = s.accept()
    print("n0 got", c.recv(64).decode(), "from", a[0], flush=True)
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            c = socket.create_connection(("n0", int(os.environ["PORT"])), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    c.sendall(socket.gethostname().encode())"""


def test_a_two_rank_hydra_job_exchanges_data_between_hosts(bed):
    cmd = [mpiexec(), *bed.launcher_args(), "-hosts", "n0,n1", "-n", "2",
           sys.executable, "-c", EXCHANGE]  # fmt: skip
    env = rank_env(PORT="29431")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=T, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["n0", "got", "n1", "from", bed.address("n1")]


MPI_ALLREDUCE = """from mpi4py import MPI
import socket
import os
c = MPI.COMM_WORLD
line = f"{c.rank} {socket.gethostname()} {c.allreduce(c.rank + 1)}"
open(os.path.join(os.environ["OUT"], f"rank-{c.rank}"), "w").write(line)"""

GLOO_ALLREDUCE = """import os, socket
import torch, torch.distributed as dist
rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=size)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
line = f"{rank} {socket.gethostname()} {int(t.item())}"
open(os.path.join(os.environ["OUT"], f"rank-{rank}"), "w").write(line)
dist.destroy_process_group()"""


@pytest.mark.slow
@pytest.mark.parametrize("program", [MPI_ALLREDUCE, GLOO_ALLREDUCE], ids=["mpi", "gloo"])
def test_a_collective_across_hosts(bed, program, tmp_path):
    """MPICH's own transport (UCX over TCP: the hosts' IPC namespaces and boot ids keep it off
    shared memory) and torch's gloo with MASTER_ADDR=n0."""
    cmd = [mpiexec(), *bed.launcher_args(), "-hosts", "n0,n1", "-n", "2",
           sys.executable, "-c", program]  # fmt: skip
    env = rank_env(MASTER_ADDR="n0", MASTER_PORT="29435", OUT=str(tmp_path))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    # into files (the shared file system): Hydra forwards the ranks' output in chunks, and
    # two ranks' lines can come cut into each other ("01 n0 3\n n1 3")
    said = [(tmp_path / f"rank-{r}").read_text() for r in (0, 1)]
    assert said == ["0 n0 3", "1 n1 3"]


def test_the_launcher_exec_takes_ssh_options_and_keeps_the_directory(bed, tmp_path):
    done = ssh("-x", "-o", "BatchMode=yes", "-p", "22", "root@n1", "echo", "$(hostname)", "in",
               "$PWD;", "exit", "3", cwd=tmp_path)  # fmt: skip
    assert (done.returncode, done.stdout.split()) == (3, ["n1", "in", str(tmp_path)])
    assert ssh(bed.address("n0"), "hostname").stdout == "n0\n"
    unknown = ssh("n9", "true")
    assert unknown.returncode == 255 and "Could not resolve hostname n9" in unknown.stderr


def test_the_launcher_exec_passes_only_stdio_so_a_failed_launch_leaves_no_proxy(bed, tmp_path):
    """As ssh closes every descriptor above stderr: Hydra's own (its listening socket among
    them) left open in a host kept that host's proxy waiting on a dead mpiexec for good, after
    a launch that failed on another host (n1 cut)."""
    with open(tmp_path / "held", "w") as held:
        fds = subprocess.run([str(testbed.LAUNCHER), "n0", "ls", "/proc/self/fd"],
                             pass_fds=(held.fileno(),), capture_output=True, text=True,
                             timeout=T)  # fmt: skip
    assert sorted(fds.stdout.split()) == ["0", "1", "2", "3"], fds  # 3: ls's own, of /proc
    bed.cut("n1")
    try:
        failed = subprocess.run([mpiexec(), *bed.launcher_args(), "-hosts", "n0,n1", "-n", "2",
                                 "sleep", "60"], capture_output=True, text=True,
                                timeout=T)  # fmt: skip
        assert failed.returncode != 0
        time.sleep(1)
        left = bed.exec("n0", ["pgrep", "-a", "hydra_pmi_proxy"], capture_output=True,
                        text=True, timeout=T)  # fmt: skip
        assert left.stdout == "", left.stdout
    finally:
        bed.heal("n1")


def test_the_command_line_exec_passes_stdin_stdout_and_exit_status(bed):
    cmd = [sys.executable, "-m", "testbed", "exec", "n0", "sh", "-c",
           'read x; echo "$x on $(hostname)"; exit 3']  # fmt: skip
    done = subprocess.run(cmd, input="hi\n", capture_output=True, text=True, timeout=T, cwd=REPO)
    assert (done.returncode, done.stdout) == (3, "hi on n0\n")
    status = subprocess.run([sys.executable, "-m", "testbed", "status"], capture_output=True,
                            text=True, timeout=T, cwd=REPO)  # fmt: skip
    assert status.returncode == 0 and "n1    10.233.0.11   up" in status.stdout


def test_the_launcher_exec_inside_a_host_reaches_another_host(bed):
    """From n0 (its own PID namespace, from which n1 cannot be entered) through the bed's sshd:
    streams, directory and status pass; a killed host is unreachable from there too."""
    ssh = str(testbed.LAUNCHER)
    words = [ssh, "-x", "n1", 'read x; echo "$x on $(hostname) in $PWD"; exit 5']
    done = bed.exec("n0", words, cwd=str(REPO), input="hi\n", capture_output=True, text=True,
                    timeout=T)  # fmt: skip
    assert (done.returncode, done.stdout) == (5, f"hi on n1 in {REPO}\n"), done.stderr
    bed.kill("n1")
    gone = bed.exec("n0", [ssh, "n1", "hostname"], capture_output=True, text=True, timeout=T)
    assert gone.returncode == 255 and "No route to host" in gone.stderr


def test_kill_ends_every_process_of_the_host_at_once_and_empties_its_shm(bed):
    far = subprocess.Popen([str(testbed.LAUNCHER), "n1",
                            "echo data > /dev/shm/f; echo data > $TB_SCRATCH/f;"
                            " sleep 300 & sleep 300 & echo started; wait"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "TB_SCRATCH": str(testbed.SCRATCH)})  # fmt: skip
    assert far.stdout.readline() == "started\n"
    victims = bed.pids("n1")
    assert len(victims) >= 3
    started = time.monotonic()
    bed.kill("n1")
    assert time.monotonic() - started < 5
    assert [p for p in victims if alive(p)] == []
    assert bed.pids("n1") == [] and bed.state("n1") == "killed"
    assert far.wait(timeout=T) == 255  # the session ended as ssh's does when its host dies
    assert "closed by remote host" in far.stderr.read()
    refused = ssh("n1", "true")
    assert refused.returncode == 255
    assert "ssh: connect to host n1 port 22: No route to host" in refused.stderr
    assert out(bed, "n0", "hostname") == "n0"  # the other host is untouched
    bed.heal("n1")
    listing = out(bed, "n1", "ls", "-A", "/dev/shm", str(testbed.SCRATCH)).split()
    assert listing == ["/dev/shm:", f"{testbed.SCRATCH}:"]  # both fresh and empty
    assert ssh("n1", "hostname").stdout == "n1\n"


def test_cut_keeps_the_processes_but_nothing_reaches_them_until_heal(bed):
    listen = ("import socket; s = socket.create_server(('n1', 29433)); s.settimeout(30);"
              "print('up', flush=True); c, a = s.accept(); print(a[0])")  # fmt: skip
    server = bed.popen("n1", [sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline() == "up\n"
    bed.cut("n1")
    assert bed.state("n1") == "cut"
    cut = bed.exec("n0", [sys.executable, "-c", CONNECT, "n1", "29433", "1"],
                   capture_output=True, text=True, timeout=T)  # fmt: skip
    assert cut.returncode != 0 and ("timed out" in cut.stderr or "No route" in cut.stderr)
    assert ssh("n1", "true").returncode == 255
    assert server.poll() is None and bed.pids("n1")  # alive, unreachable
    bed.heal("n1")
    out(bed, "n0", sys.executable, "-c", CONNECT, "n1", "29433", "5")
    assert server.communicate(timeout=T)[0].strip() == bed.address("n0")


def test_up_reuses_the_same_bed_and_refuses_another(bed):
    assert testbed.up(2) == bed
    with pytest.raises(testbed.BedError, match="down"):
        testbed.up(3)


def leftovers(net_inodes: set[int], hosts_before: str) -> list[str]:
    """What a bed left on the machine: namespaces, links, mounts, processes, files."""
    mounts = Path("/proc/self/mountinfo").read_text()
    found = [f"netns {n}" for n in network.bed_netns() if n.startswith(NETNS_PREFIX)]
    found += [f"link {n}" for n in os.listdir("/sys/class/net") if n.startswith(BRIDGE)]
    found += [f"mount at {p}" for p in (testbed.RUN_DIR, testbed.SCRATCH) if f" {p}" in mounts]
    found += [f"process {p}" for p in procs.members("net", net_inodes)]
    found += [f"path {p}" for p in (testbed.RUN_DIR, testbed.SCRATCH) if p.exists()]
    relays = subprocess.run(["pgrep", "-f", "testbed/relay.py serve"], capture_output=True)
    found += [f"relay {p}" for p in relays.stdout.decode().split()]
    if HOSTS_FILE.read_text() != hosts_before:
        found.append("/etc/hosts changed")
    return found


def test_down_leaves_nothing_behind(bed_module):
    testbed.down()
    hosts_before = HOSTS_FILE.read_text()
    bed = testbed.up(2)
    inodes = {network.netns_inode(f"{NETNS_PREFIX}{h}") for h in bed.hosts}
    sleeper = bed.popen("n0", ["sleep", "300"])
    far = subprocess.Popen([str(testbed.LAUNCHER), "n1", "sleep 300"])
    deadline = time.monotonic() + T
    while len(procs.members("net", inodes)) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)  # 2 inits and their unshare, the two sessions
    testbed.down()
    assert leftovers(inodes, hosts_before) == []
    assert sleeper.wait(timeout=T) != 0 and far.wait(timeout=T) != 0


def test_down_after_whoever_ran_up_is_gone(bed_module):
    testbed.down()
    hosts_before = HOSTS_FILE.read_text()
    cli = [sys.executable, "-m", "testbed"]
    up = subprocess.run([*cli, "up", "2"], capture_output=True, text=True, timeout=T, cwd=REPO)
    assert up.returncode == 0, up.stderr
    inodes = {network.netns_inode(f"{NETNS_PREFIX}n{k}") for k in range(2)}
    orphan = subprocess.Popen([*cli, "exec", "n0", "sleep", "300"], cwd=REPO,
                              start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + T
    while not procs.members("net", inodes) and time.monotonic() < deadline:
        time.sleep(0.02)
    relay = int((testbed.RUN_DIR / "relay.pid").read_text())
    shutil.rmtree(testbed.RUN_DIR)  # even its state lost: down finds the bed by what exists
    done = subprocess.run([*cli, "down"], capture_output=True, text=True, timeout=T, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert leftovers(inodes, hosts_before) == []
    assert orphan.wait(timeout=T) != 0
    deadline = time.monotonic() + T  # the bed's sshd ends once its socket is gone
    while alive(relay) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(relay)
