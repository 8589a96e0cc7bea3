"""A test bed of real hosts on one machine: each host `nK` is a set of Linux namespaces (its own
network with an address on a bridge, hostname, PID space, /dev/shm and node-local scratch) over
the machine's shared file system; MPICH Hydra reaches them through `testbed/ssh`.

    bed = testbed.up(2)            # n0, n1 (needs root; testbed.available() says why not)
    bed.exec("n0", ["hostname"])   # subprocess.run in the host
    bed.kill("n1"); bed.heal("n1"); bed.cut("n0"); bed.heal("n0")
    bed.down()                     # or testbed.down(): nothing left behind
    bed = testbed.up(4, slurm_cluster=True)  # and Slurm: slurmctld here, a slurmd per host

Standard library only (no torch), and nothing of the project's other packages.
"""

from testbed.bed import LAUNCHER, Bed, HostStatus, current, down, up
from testbed.commands import BedError
from testbed.layout import HEAD_ADDRESS, RUN_DIR, SCRATCH
from testbed.probe import available
from testbed.slurm import missing as slurm_missing

__all__ = [
    "HEAD_ADDRESS", "LAUNCHER", "RUN_DIR", "SCRATCH", "Bed", "BedError", "HostStatus",
    "available", "current", "down", "slurm_missing", "up",
]  # fmt: skip
