"""Who this rank is, on which device, and the process group it trains in.

Rank and world come from whatever launcher started the process; MPI, when it started us,
is used only to agree on a rendezvous address and to bring the whole job down on an error.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct
import sys
import termios
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

# (rank, world, local rank, local world) variable names per launcher, most specific first.
LAUNCHER_VARS: tuple[tuple[str, str, str, str, str], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("pals", "PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("pmix", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
MPI_LAUNCHERS = frozenset({"pals", "openmpi", "hydra", "pmix"})


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    local_rank: int
    local_world: int
    launcher: str
    host: str

    @property
    def under_mpi(self) -> bool:
        return self.launcher in MPI_LAUNCHERS


def detect_rank(env: Mapping[str, str], host: str | None = None) -> RankInfo:
    """Pure: this process's place in the job from its environment; a lone process is rank 0 of 1."""
    host = host or socket.gethostname()
    for launcher, rank_var, world_var, local_var, local_world_var in LAUNCHER_VARS:
        if rank_var in env and (world_var in env or launcher == "pmix"):
            world = int(env.get(world_var) or env.get("PMI_SIZE") or 1)
            # A launcher that gives no local rank under srun (its PMI plugin sets PMI_RANK
            # alone) leaves Slurm's: else every rank of a node would take device 0.
            if local_var not in env and "SLURM_LOCALID" in env:
                local_var, local_world_var = "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"
            local_world_raw = env.get(local_world_var, "")
            # Slurm writes e.g. "4(x2)"; the leading count is this node's.
            local_world = int(local_world_raw.split("(")[0]) if local_world_raw else world
            return RankInfo(
                rank=int(env[rank_var]),
                world=world,
                local_rank=int(env.get(local_var, 0)),
                local_world=local_world,
                launcher=launcher,
                host=host,
            )
    return RankInfo(0, 1, 0, 1, "single", host)


def select_device(requested: str):
    """`auto` takes CUDA, then XPU, then CPU; returns (torch.device type, backend name)."""
    import torch

    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            requested = "xpu"
        else:
            requested = "cpu"
    if requested == "cuda":
        return "cuda", "nccl"
    if requested == "xpu":
        try:  # oneCCL bindings register the "ccl" backend when imported
            import oneccl_bindings_for_pytorch  # noqa: F401

            return "xpu", "ccl"
        except ImportError:
            return "xpu", "xccl"
    return "cpu", "gloo"


def set_threads(info: RankInfo) -> int:
    """Honour OMP_NUM_THREADS; else share this node's cores among its ranks (under mpiexec
    torch otherwise drops silently to one thread)."""
    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads <= 0:
        threads = max(1, (os.cpu_count() or 1) // max(1, info.local_world))
    torch.set_num_threads(threads)
    return threads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous_address(info: RankInfo) -> tuple[str, int]:
    """MASTER_ADDR/PORT when given; under MPI, rank 0 picks a port and tells the others."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return addr, int(port)
    if info.world == 1:
        return "127.0.0.1", _free_port()
    if not info.under_mpi:
        raise RuntimeError(
            f"launched by {info.launcher} without MASTER_ADDR/MASTER_PORT; set both, "
            "or launch with mpiexec or torchrun"
        )
    comm = mpi_world()
    if comm.Get_rank() == 0:
        single_node = info.local_world == info.world
        choice = ("127.0.0.1" if single_node else socket.getfqdn(), _free_port())
    else:
        choice = None
    return comm.bcast(choice, root=0)


# Shared-memory segments MPICH names in /dev/shm (ch4 posix: `mpich_shm_<world>_<node>`, and
# `mpich_vci_<world>_<node>` with more than one VCI). Only MPI_Finalize unlinks them.
MPI_SHM_PREFIXES = ("mpich_shm_", "mpich_vci_")


def mpi_shm_paths(maps: str, prefixes: tuple[str, ...] = MPI_SHM_PREFIXES) -> list[str]:
    """Pure: the MPI shared-memory files a `/proc/<pid>/maps` text shows mapped (once each,
    in order; those already unlinked, `… (deleted)`, left out)."""
    found: list[str] = []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5]
        if path.endswith(" (deleted)"):
            continue
        directory, _, name = path.rpartition("/")
        if directory and name.startswith(prefixes) and path not in found:
            found.append(path)
    return found


def release_mpi_shm(maps_path: str = "/proc/self/maps") -> list[str]:
    """Unlink the names of MPI's node shared memory that this process maps; the mappings stay
    and the memory goes with the last rank of the node, however it ends. Call it only once
    every local rank has mapped them (after MPI_Init on all: `mpi_world`'s barrier). MPICH
    unlinks them only in MPI_Finalize, so every SIGKILLed rank (and every MPI_Abort or
    `os._exit`) left one segment per node in /dev/shm. Returns what it unlinked."""
    try:
        with open(maps_path) as f:
            maps = f.read()
    except OSError:
        return []
    released = []
    for path in mpi_shm_paths(maps):
        try:
            os.unlink(path)
        except OSError:  # another local rank was first, or it is not ours to remove
            continue
        released.append(path)
    return released


def mpi_world():
    """MPI's COMM_WORLD, initialised on first use (importing mpi4py runs MPI_Init); once every
    rank is past MPI_Init (a barrier), the node's MPI shared-memory names are released, so a
    rank killed later leaves nothing in /dev/shm (under the supervisor or by hand)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    global _mpi_shm_released
    if not _mpi_shm_released:
        comm.Barrier()
        release_mpi_shm()
        _mpi_shm_released = True
    return comm


_mpi_shm_released = False


STORE_POLL_S = 0.005  # how often a rank looks again for rank 0's store


def wait_for_store(addr: str, port: int, timeout_s: float) -> None:
    """Until rank 0's rendezvous store accepts connections (or `timeout_s`: torch's own connect
    then says what is wrong). A rank that reaches the store before rank 0 made it has torch's
    client back off between tries: 0.44 s for a store that came 0.05 s late, measured here,
    which every rank of the group then waits for."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(STORE_POLL_S)


def init_process_group(info: RankInfo, backend: str, device_type: str, timeout_s: float):
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    elif device_type == "xpu":
        torch.xpu.set_device(info.local_rank)
    addr, port = rendezvous_address(info)
    if info.rank != 0:
        wait_for_store(addr, port, timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{addr}:{port}",
        rank=info.rank,
        world_size=info.world,
        timeout=timedelta(seconds=timeout_s),
    )
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, info.local_rank)


def abort_job(info: RankInfo, code: int) -> None:
    """End this rank so that its peers cannot hang: MPI_Abort under MPI (the launcher then
    kills every rank), else a hard exit that skips process-group and MPI finalizers."""
    for fd in flush_output():
        wait_until_read(fd, OUTPUT_DRAIN_S)
    if info.under_mpi and info.world > 1 and "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def abort_unformed(info: RankInfo, code: int) -> int:
    """A rank that refused its input before the world formed, by a check whose answer may
    differ between ranks (its host's directories, a lock another job let go of in between):
    under MPI with no rendezvous given, its peers wait for it in MPI_Init, and Hydra ends no
    job for a process that exits before it; so it starts MPI too and aborts, and the launcher
    ends them all. Otherwise `code`, to return: the peers' rendezvous times out, or a
    supervisor or torchrun ends them."""
    given = os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    if info.under_mpi and info.world > 1 and not given:
        mpi_world()  # MPI_Init, with the peers
        abort_job(info, code)
    return code


def end_process(code: int) -> None:
    """End a rank whose run is over (trained, stopped, told to exit, or refused its input):
    flush its output, finalize MPI if it was started, and exit without the interpreter's
    teardown. A process group that outlives `destroy_process_group` (the model and mesh still
    hold it) keeps gloo's worker threads, which may still be releasing finished work that holds
    Python tensors; a GIL taken by one of them during finalization aborts the process (SIGABRT,
    `terminate called without an active exception`; seen in 3 of 25 runs on a loaded host), so
    a finished run would end as a failure."""
    flush_output()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(code)


def flush_output() -> list[int]:
    """Flush stdout and stderr where they are open; a stream closed or gone (run with `>&-`,
    a reader that left) is passed over, never raised from on the way out. Returns the file
    descriptors flushed."""
    fds = []
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            fds.append(stream.fileno())
        except (AttributeError, OSError, ValueError):
            continue
    return fds


OUTPUT_DRAIN_S = 2.0  # how long an aborting rank waits for the launcher to read its last words


def wait_until_read(fd: int, timeout_s: float) -> None:
    """Wait, at most `timeout_s`, until whoever reads the pipe `fd` has taken all we wrote:
    an abort kills the launcher's proxy, and bytes it had not read yet (the error line) were
    lost with it (seen under load). Only pipes: a file or a terminal has nothing to wait for."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except OSError:
        return
    deadline = time.monotonic() + timeout_s
    buf = bytearray(4)
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, buf)
        except OSError:
            return
        if struct.unpack("i", buf)[0] == 0:
            return
        time.sleep(0.005)
