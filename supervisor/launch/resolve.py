"""What `run` fixes once for the whole job: run dir, nodes, launcher program and flavor.

Every attempt launches the job's active nodes with the same command (until a node is excluded:
a spare takes its place, or with a shrink the world gets smaller and the worker flags follow);
`validate` and `--dry-run` resolve too, so that whatever can only be checked once the nodes are
known (a fault's target rank) is caught before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.launch import hosts
from supervisor.launch.kinds import LauncherKind
from supervisor.launch.plan import LaunchPlan
from supervisor.launch.registry import launcher_for
from supervisor.policy.nodes import NodePool
from supervisor.policy.prepared_rules import template_unavailable
from supervisor.policy.standby_rules import standby_unavailable
from supervisor.settings import checks, toml_dump, worker_flags, worker_spec
from supervisor.settings import config as config_mod
from supervisor.settings.config import Config

PREPARED_MODULE = "worker.prepared"  # a rank with no number yet ([restart] warm_spare)
TEMPLATE_MODULE = "worker.template"  # a node's fork template ([restart] template)


@dataclass
class Resolved:
    """The job as it runs: every node it was given (`nodes`, spares included), which of them run
    the ranks now (`pool`), and the worker flags a smaller world needs (`worker_overrides`)."""

    cfg: Config
    run_dir: Path
    nodes: list[str]
    executable: str
    flavor: str
    pool: NodePool = field(init=False)
    worker_overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(
        default_factory=list
    )  # what resolving chose that the user may not expect

    def __post_init__(self) -> None:
        self.pool = NodePool.split(self.nodes, self.cfg.launch.spares)

    @property
    def template_off(self) -> str | None:
        """Why the job's ranks are not forked from fork templates, or None when they are."""
        return template_unavailable(
            wanted=self.cfg.restart.template,
            launcher_cannot=self.kind.node_launches(self.flavor),
            module=self.cfg.worker.module,
        )

    @property
    def standby_off(self) -> str | None:
        """Why the job keeps no warm standby, or None when it does (its worker declares it)."""
        module = self.cfg.worker.module
        declared = worker_spec.declares_standby(checks.spec_of(self.cfg), module)
        return standby_unavailable(
            wanted=self.cfg.restart.standby, declared=declared, module=module
        )

    @property
    def kind(self) -> LauncherKind:
        """The configured launcher."""
        return launcher_for(self.cfg.launch.launcher)

    @property
    def active(self) -> list[str]:
        return list(self.pool.active)

    @property
    def world(self) -> int:
        return len(self.pool.active) * self.cfg.launch.ranks_per_node

    def hostfile(self) -> Path:
        return self.run_dir / "hostfile"

    def write_hostfile(self) -> None:
        """The active nodes, one per line (the launcher's -f / --hostfile)."""
        self.hostfile().write_text("".join(f"{n}\n" for n in self.pool.active))

    def plan(self, env: dict[str, str], master_port: int = 0) -> LaunchPlan:
        """An attempt's launch. Ranks forked from templates, and srun's (no MPI under it), are
        given their rendezvous (a port good on rank 0's host): forked ones never start MPI, so
        Hydra, which ends a job's other processes the moment one that started MPI exits, leaves
        each client the time to mirror its rank's end."""
        template = self.template_off is None
        given = template or not self.kind.ranks_agree_rendezvous
        return self.kind.plan(
            self.cfg,
            self.active,
            self.executable,
            self.flavor,
            env,
            self.hostfile(),
            master_port or (self.rendezvous_port() if given else 0),
            self.worker_overrides,
            template=template,
        )

    def rendezvous_port(self) -> int:
        """MASTER_PORT for the active nodes' ranks, good on rank 0's host (`hosts`)."""
        local = self.cfg.launch.emulate_nodes
        return hosts.free_port() if local else hosts.rendezvous_port(self.active[0])

    def prepared_plan(self, env: dict[str, str], node: str) -> LaunchPlan:
        """Prepared ranks on one node, a launch of their own (worker.prepared, the same flags)."""
        worker = dataclasses.replace(self.cfg.worker, module=PREPARED_MODULE)
        cfg = dataclasses.replace(self.cfg, worker=worker)
        return self.kind.plan(
            cfg, [node], self.executable, self.flavor, env, None, 0, self.worker_overrides,
            template=self.template_off is None,
        )  # fmt: skip

    def template_plan(self, env: dict[str, str], node: str) -> LaunchPlan:
        """One node's fork template: one process, a launch of its own (worker.template)."""
        launch = dataclasses.replace(self.cfg.launch, ranks_per_node=1)
        worker = dataclasses.replace(self.cfg.worker, module=TEMPLATE_MODULE, flags={})
        cfg = dataclasses.replace(self.cfg, launch=launch, worker=worker)
        return self.kind.plan(cfg, [node], self.executable, self.flavor, env, None, 0)

    def dry_run_text(self, label: str) -> str:
        """What `--dry-run` prints: the resolved config and the first attempt's launch command
        (the job's secrets and its address as placeholders)."""
        env = {
            "ES_JOB_ID": "<job>",
            "ES_ATTEMPT": "0",
            "ES_HEARTBEAT_ADDR": "<addr>",
            "ES_HEARTBEAT_KEY": "<secret>",
            "ES_ATTEMPT_DIR": str(self.run_dir / "attempts" / "000"),
        }
        return (
            f"# resolved config ({label})\n{toml_dump.dumps(self.resolved_dict())}\n"
            f"# launch command (attempt 0)\n{self.plan({**self.cfg.launch.env, **env}).text()}"
        )

    def summary(self) -> str:
        """`mpiexec [hydra], 2 node(s) x 2 ranks = 4 + 1 spare, worker worker.train` (validate's
        ok): the ranks are the active nodes', so the spares are said apart."""
        launch = self.cfg.launch
        spares = len(self.pool.spares)
        extra = f" + {spares} spare{'' if spares == 1 else 's'}" if spares else ""
        return (
            f"{launch.launcher} [{self.flavor}], {len(self.pool.active)} node(s) x "
            f"{launch.ranks_per_node} ranks = {self.world}{extra}, worker {self.cfg.worker.module}"
        )

    def resolved_dict(self) -> dict[str, Any]:
        d = toml_dump.to_dict(self.cfg)
        d["job"]["run_dir"] = str(self.run_dir)
        d["launch"]["nodes"] = list(self.nodes)
        d["launch"]["executable"] = self.executable
        if self.kind.has_flavors:
            d["launch"]["flavor"] = self.flavor
        return d


def resolve(cfg: Config, environ: dict[str, str] | None = None) -> Resolved:
    """Fix run dir, nodes, launcher and its flavor; raise ConfigError / LauncherMissing."""
    environ = dict(os.environ if environ is None else environ)
    run_dir = config_mod.expand_run_dir(cfg)
    flags = cfg.worker.flags
    flags.setdefault("ckpt_dir", str(run_dir / "ckpt"))
    # the memory tier's default ("auto": on, with the ckpt_dir above) said, for what reads it
    memory = worker_flags.with_defaults(cfg).get("mem_ckpt_interval")
    if memory is not None:
        flags.setdefault("mem_ckpt_interval", memory)
    for key, value in flags.items():
        if isinstance(value, str):
            flags[key] = value.replace("{run_dir}", str(run_dir)).replace("{name}", cfg.job.name)
    kind = launcher_for(cfg.launch.launcher)
    nodes = kind.nodes(cfg.launch, environ, cfg.source)
    for node in nodes:  # from a host file or the batch job: checked as a list in the config is
        problem = checks.host_problem(node)
        if problem:
            key = "launch.hostfile" if cfg.launch.hostfile else "launch.nodes"
            raise config_mod.ConfigError(
                cfg.source, key, f"{problem} (from {_nodes_source(cfg.launch, environ)})"
            )
    note = nodes_note(cfg.launch, environ, nodes)
    executable = kind.executable(cfg)
    flavor = kind.flavor(cfg, executable)
    if cfg.launch.emulate_nodes and flavor != "hydra":
        raise config_mod.ConfigError(
            cfg.source,
            "launch.emulate_nodes",
            f"emulated nodes need MPICH Hydra's fork launcher; {executable} is {flavor}",
        )
    if cfg.launch.spares >= len(nodes):
        raise config_mod.ConfigError(
            cfg.source,
            "launch.spares",
            f"{cfg.launch.spares} spare(s) leave none of the {len(nodes)} node(s) to run on",
        )
    if cfg.restart.min_nodes > len(nodes) - cfg.launch.spares:
        raise config_mod.ConfigError(
            cfg.source,
            "restart.min_nodes",
            f"{cfg.restart.min_nodes} is more than the {len(nodes) - cfg.launch.spares} "
            "node(s) the job starts on",
        )
    if cfg.faults:  # faults/: a rank or node beyond the resolved world is a config error too
        from faults import check_world, partition_problem, shape_of

        check_world(cfg.faults, cfg.source, shape_of(cfg, len(nodes) - cfg.launch.spares))
        cuts = [f for f in cfg.faults if f.action.kind == "partition"]
        if cuts and (why := partition_problem(nodes, cfg.launch.emulate_nodes)) is not None:
            raise config_mod.ConfigError(cfg.source, f"faults[{cuts[0].index}].action", why)
    return Resolved(cfg, run_dir, nodes, executable, flavor, notes=[note] if note else [])


def _nodes_source(launch: config_mod.LaunchConfig, environ: dict[str, str]) -> str:
    if launch.hostfile:
        return launch.hostfile
    if isinstance(launch.nodes, list):
        return "the list"
    return "PBS_NODEFILE" if environ.get("PBS_NODEFILE") else "SLURM_JOB_NODELIST"


def nodes_note(
    launch: config_mod.LaunchConfig, environ: dict[str, str], nodes: list[str]
) -> str | None:
    """A note when `nodes = "auto"` found no batch job's node list and fell back to this host:
    a multi-node config validated on a login node or laptop would else say ok for one node."""
    listed = launch.hostfile or isinstance(launch.nodes, list)
    batch = environ.get("PBS_NODEFILE") or environ.get("SLURM_JOB_NODELIST")
    if listed or batch or launcher_for(launch.launcher).this_host_only:
        return None
    return (
        f'launch.nodes = "auto": no PBS_NODEFILE or SLURM_JOB_NODELIST here, so the job runs '
        f"on this host only ({', '.join(nodes)})"
    )
