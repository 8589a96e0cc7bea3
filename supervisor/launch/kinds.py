"""The launcher kinds, one class each: `mpiexec` (MPICH Hydra or Cray PALS), `srun`, and `local`
(N ranks on this host, no MPI, torchrun-style variables). A kind finds its program and flavor,
lists its nodes, and builds an attempt's plan (pure: `processes.py` acts on it), with the signal
that asks its ranks to stop (the worker saves on TERM and USR1)."""

from __future__ import annotations

import functools
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

from contracts.config_table import ConfigError
from supervisor.launch import hosts
from supervisor.launch.plan import LaunchPlan, ProcSpec, python_of, worker_argv
from supervisor.settings.config import Config, LaunchConfig
from supervisor.settings.launcher_kinds import KIND_FACTS


class LauncherMissing(ConfigError):
    """The configured launcher program is not on this host."""


class LauncherKind:
    """One value of `launch.launcher`: what the rest of the code asks of a launcher."""

    name: ClassVar[str]
    # Its nodes are reached by host name (Hydra's ssh, PALS), so each must resolve here.
    reaches_nodes_by_name: ClassVar[bool] = False
    # It comes in flavors (Hydra, PALS), so the resolved config shows the one found.
    has_flavors: ClassVar[bool] = False
    # Its ranks agree on a rendezvous themselves (over MPI), else the plan must carry one.
    ranks_agree_rendezvous: ClassVar[bool] = True
    stop_signal: ClassVar[signal.Signals] = signal.SIGTERM

    @property
    def this_host_only(self) -> bool:
        """It starts every rank on this host itself: no node to check, no host file."""
        return KIND_FACTS[self.name].this_host_only

    def nodes(self, launch: LaunchConfig, environ: Mapping[str, str], source: str) -> list[str]:
        """The attempt's hosts, fixed for the whole job (the same nodes on every attempt)."""
        return hosts.listed_nodes(launch, environ, source)

    def executable(self, cfg: Config) -> str:
        """The launcher program's path, or LauncherMissing naming it."""
        name = cfg.launch.executable or self.name
        path = shutil.which(name)
        if not path:
            key = "launch.executable" if cfg.launch.executable else "launch.launcher"
            raise LauncherMissing(cfg.source, key, f"launcher program {name!r} not found on PATH")
        return path

    def flavor(self, cfg: Config, executable: str) -> str:
        """Which variant of the launcher `executable` is (ConfigError when it cannot tell)."""
        return self.name

    def master_port(self) -> int:
        """MASTER_PORT for an attempt's ranks; 0 where the launcher's own variables do."""
        return 0

    def node_launches(self, flavor: str) -> str | None:
        """Why this launcher cannot start one node's processes as a launch of their own beside
        the job's (prepared ranks, [restart] warm_spare), or None where it can."""
        return f"{self.name} cannot start one node's prepared ranks on their own"

    def plan(
        self,
        cfg: Config,
        nodes: list[str],
        executable: str,
        flavor: str,
        env: dict[str, str],
        hostfile: Path | None = None,
        master_port: int = 0,
        overrides: Mapping[str, object] | None = None,
        template: bool = False,
    ) -> LaunchPlan:
        """The processes of one attempt on `nodes` (the active ones). `env` is the contract
        environment plus [launch] env; `overrides`: worker flags a smaller world needs;
        `template`: each rank forked by its node's template (worker.template_client)."""
        raise NotImplementedError


class Local(LauncherKind):
    """No launcher: the supervisor starts each rank on this host with torchrun's variables."""

    name = "local"

    def nodes(self, launch: LaunchConfig, environ: Mapping[str, str], source: str) -> list[str]:
        if isinstance(launch.nodes, list) and not all(hosts.is_this_host(n) for n in launch.nodes):
            raise ConfigError(source, "launch.nodes", "the local launcher runs on this host only")
        return [hosts.this_host()]

    def executable(self, cfg: Config) -> str:
        return python_of(cfg.launch)

    def master_port(self) -> int:
        return hosts.free_port()

    def plan(
        self,
        cfg: Config,
        nodes: list[str],
        executable: str,
        flavor: str,
        env: dict[str, str],
        hostfile: Path | None = None,
        master_port: int = 0,
        overrides: Mapping[str, object] | None = None,
        template: bool = False,
    ) -> LaunchPlan:
        world = cfg.launch.ranks_per_node * len(nodes)
        worker = worker_argv(cfg, overrides, template)
        procs = []
        for r in range(world):
            rank_env = {
                **env,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
            }
            rank_env.setdefault("OMP_NUM_THREADS", "1")
            procs.append(ProcSpec(list(worker), rank_env, label=f"[{r}] ", rank=r))
        return LaunchPlan("local", procs, world, nodes, self.stop_signal)


class Srun(LauncherKind):
    """Slurm's `srun`, run inside the job's allocation: Slurm places the ranks on the nodes
    named. Every launch is a step of that allocation: the attempt, its standby, the node checks
    and cleans, each node's template and prepared ranks (steps of one node); all take
    `--overlap` to share the allocation's CPUs. The ranks start no MPI here: the plan gives
    them the rendezvous (rank 0's host and a port drawn for that launch)."""

    name = "srun"
    ranks_agree_rendezvous = False
    stop_signal = signal.SIGUSR1  # srun forwards it to the tasks

    def node_launches(self, flavor: str) -> str | None:
        return None  # `--nodelist=<node>`, a step of its own

    def nodes(self, launch: LaunchConfig, environ: Mapping[str, str], source: str) -> list[str]:
        """The allocation's nodes, or those listed of them: srun outside an allocation would
        make one of its own for every launch, and a node outside it fails as unreachable."""
        if not environ.get("SLURM_JOB_ID"):
            raise ConfigError(source, "launch.launcher", SRUN_OUTSIDE)
        listed = hosts.listed_nodes(launch, environ, source)
        nodelist = environ.get("SLURM_JOB_NODELIST", "")
        allocated = hosts.slurm_hosts(nodelist, source) if nodelist else listed
        outside = [n for n in listed if n not in allocated]
        if outside:
            raise ConfigError(
                source, "launch.nodes",
                f"{', '.join(outside)} not in the allocation (SLURM_JOB_NODELIST={nodelist}); "
                'list only its nodes, or nodes = "auto"',
            )  # fmt: skip
        return listed

    def plan(
        self,
        cfg: Config,
        nodes: list[str],
        executable: str,
        flavor: str,
        env: dict[str, str],
        hostfile: Path | None = None,
        master_port: int = 0,
        overrides: Mapping[str, object] | None = None,
        template: bool = False,
    ) -> LaunchPlan:
        per_node = cfg.launch.ranks_per_node
        world = per_node * len(nodes)
        argv = [
            executable,
            f"--nodes={len(nodes)}",
            f"--ntasks={world}",
            f"--ntasks-per-node={per_node}",
            f"--nodelist={','.join(nodes)}",
            "--label",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            "--overlap",  # the job's other steps (standby, templates, checks) share the CPUs
            *cfg.launch.args,
            *worker_argv(cfg, overrides, template),
        ]
        if master_port:
            master = "127.0.0.1" if hosts.is_this_host(nodes[0]) else nodes[0]
            env = {**env, "MASTER_ADDR": master, "MASTER_PORT": str(master_port)}
        # srun would wait out Slurm's KillWait for a rank stuck in a collective: killed at
        # once, Slurm ends the step's tasks itself when it sees srun gone
        return LaunchPlan("srun", [ProcSpec(argv, env)], world, nodes, self.stop_signal,
                          launcher_exit_s=0.0)  # fmt: skip


SRUN_OUTSIDE = (
    "srun runs inside a Slurm allocation, and there is none here (no SLURM_JOB_ID): run the "
    "supervisor in an sbatch script or under salloc (docs/running-on-a-cluster.md)"
)


class Mpiexec(LauncherKind):
    """`mpiexec` of MPICH Hydra or Cray PALS; the flavor decides its flags and stop signal."""

    name = "mpiexec"
    reaches_nodes_by_name = True
    has_flavors = True
    # Hydra forwards SIGUSR1 to the ranks; PALS forwards SIGTERM.
    STOP_SIGNALS: ClassVar[dict[str, signal.Signals]] = {
        "hydra": signal.SIGUSR1,
        "pals": signal.SIGTERM,
    }

    def node_launches(self, flavor: str) -> str | None:
        if flavor != "hydra":  # PALS could, with --hosts: not tried
            return f"prepared ranks need MPICH Hydra's mpiexec, not {flavor}"
        return None

    def flavor(self, cfg: Config, executable: str) -> str:
        found = detect_flavor(executable)
        given = cfg.launch.flavor
        if given != "auto":  # a program that says neither is taken at its word
            if found not in ("unknown", given):
                raise ConfigError(
                    cfg.source, "launch.executable", wrong_flavor(given, found, executable)
                )
            return given
        if found == "unknown":
            raise ConfigError(
                cfg.source,
                "launch.flavor",
                f'cannot tell the flavor of {executable}; set "hydra" or "pals"',
            )
        return found

    def plan(
        self,
        cfg: Config,
        nodes: list[str],
        executable: str,
        flavor: str,
        env: dict[str, str],
        hostfile: Path | None = None,
        master_port: int = 0,
        overrides: Mapping[str, object] | None = None,
        template: bool = False,
    ) -> LaunchPlan:
        launch = cfg.launch
        per_node = launch.ranks_per_node
        world = per_node * len(nodes)
        worker = worker_argv(cfg, overrides, template)
        multi = len(nodes) > 1 or not hosts.is_this_host(nodes[0])
        if flavor == "pals":
            placed = ["--hostfile", str(hostfile)] if hostfile and multi else []
            argv = [
                executable,
                "-n",
                str(world),
                "--ppn",
                str(per_node),
                *placed,
                "--envall",
                "--label",
                *launch.args,
                *worker,
            ]
            return LaunchPlan(
                "pals", [ProcSpec(argv, env)], world, nodes, self.STOP_SIGNALS["pals"]
            )
        placed = ["-f", str(hostfile)] if hostfile and multi else []
        if multi and hostfile is None:  # a launch of its own on some nodes (prepared ranks)
            placed = ["-hosts", ",".join(nodes)]
        if launch.emulate_nodes:  # each name its own proxy and local ranks, all on this host
            placed = ["-launcher", "fork", "-hosts", ",".join(nodes)]
        argv = [
            executable,
            "-n",
            str(world),
            "-ppn",
            str(per_node),
            *placed,
            "-genvall",
            "-prepend-rank",
            *launch.args,
            *worker,
        ]
        if master_port:  # the rendezvous given, not agreed over MPI (ranks forked: `template`)
            here = launch.emulate_nodes or all(map(hosts.is_this_host, nodes))
            env = {**env, "MASTER_ADDR": "127.0.0.1" if here else nodes[0],
                   "MASTER_PORT": str(master_port)}  # fmt: skip
        return LaunchPlan("hydra", [ProcSpec(argv, env)], world, nodes, self.STOP_SIGNALS["hydra"])


FLAVOR_NAMES = {"hydra": "MPICH Hydra's mpiexec", "pals": "Cray PALS's mpiexec"}


def wrong_flavor(given: str, found: str, executable: str) -> str:
    """The mpiexec found on PATH (a virtual environment's MPICH, first on PATH on a PBS
    system) is not the flavor the config names."""
    return (
        f'flavor = "{given}", but {executable} is {FLAVOR_NAMES[found]}: set [launch] executable '
        f'to the full path of {FLAVOR_NAMES[given]}, or flavor = "auto" to run this one'
    )


@functools.lru_cache(maxsize=16)
def detect_flavor(executable: str) -> str:
    """MPICH Hydra or Cray PALS, from `mpiexec --version`; "unknown" when it says neither."""
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=30)
        text = out.stdout + out.stderr
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    if "HYDRA" in text.upper():
        return "hydra"
    if "PALS" in text.upper() or "CRAY" in text.upper():
        return "pals"
    return "unknown"
