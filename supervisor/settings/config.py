"""The job's config as typed dataclasses, one per TOML table, with their defaults: what the
rest of the supervisor reads. `loading` reads a file (and `--set`) into a checked `Config`,
`checks` says why values cannot work, `toml_dump` writes the resolved config back as TOML.
"""

from __future__ import annotations

import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from contracts.config_table import ConfigError

if TYPE_CHECKING:  # faults/ is imported only for a config that declares [[faults]]
    from faults import FaultSpec

# Worker flags that default on: `key = false` becomes `--no-key` (argparse BooleanOptionalAction).
# Any other `key = false` is left out, `key = true` becomes `--key`.
DEFAULT_ON_FLAGS = frozenset({"save_on_exit"})
DEFAULT_MODULE = "worker.train"


@dataclass
class JobConfig:
    name: str = "job"
    # `{name}` and `{time}` (UTC, YYYYmmdd-HHMMSS) are expanded once, at start.
    run_dir: str = "runs/{name}-{time}"
    # "": the run dir, checkpoint dir and all the job writes are its user's alone; a group name:
    # that group may read them too (policy/access.py).
    share_with_group: str = ""


@dataclass
class LaunchConfig:
    launcher: Literal["mpiexec", "srun", "local"] = "local"
    # mpiexec only: MPICH Hydra or Cray PALS; auto asks `mpiexec --version`.
    flavor: Literal["auto", "hydra", "pals"] = "auto"
    # The launcher program; default: the launcher's name, found on PATH.
    executable: str = ""
    # "auto" (PBS_NODEFILE, SLURM_JOB_NODELIST, else this host) or a list of host names.
    nodes: str | list[str] = "auto"
    hostfile: str = ""
    ranks_per_node: int = 1
    # Extra launcher arguments, e.g. ["--cpu-bind", "depth", "-d", "8"].
    args: list[str] = field(default_factory=list)
    # Extra environment for the ranks.
    env: dict[str, str] = field(default_factory=dict)
    # The ranks' Python; default: the supervisor's own interpreter.
    python: str = ""
    cwd: str = ""
    # Tests and demos: every named node runs on this host (MPICH Hydra's fork launcher), and the
    # supervisor and worker treat each name as a node.
    emulate_nodes: bool = False
    # The last K nodes of the resolved list start idle; one takes an excluded node's place.
    spares: int = 0
    # glibc's malloc in the ranks asks for transparent huge pages (launch/malloc_env.py): a
    # killed rank's memory is freed, and its exit seen, sooner.
    huge_pages: bool = True


@dataclass
class WorkerConfig:
    module: str = "worker.train"
    # Every other key of [worker]: a flag of the worker (`save_interval = 100`).
    flags: dict[str, Any] = field(default_factory=dict)


@dataclass
class RestartConfig:
    max_restarts: int = 10
    # Delay before relaunch, indexed by consecutive failed attempts without progress; the last
    # value repeats. A productive attempt starts the schedule over.
    backoff_s: list[float] = field(default_factory=lambda: [0.0, 1.0, 5.0, 15.0, 30.0])
    # An attempt that stepped this many steps past where it resumed starts the backoff over.
    min_progress_steps: int = 1
    # Stop (exit 4) when this many attempts in a row completed no checkpoint (durable, or a
    # memory copy every rank holds) newer than the one each resumed from.
    max_same_resume: int = 3
    # After SIGTERM to a failed attempt, before SIGKILL.
    teardown_grace_s: float = 3.0
    # On the supervisor's own SIGINT, SIGTERM or SIGHUP: time for the ranks to checkpoint and exit.
    stop_grace_s: float = 60.0
    # A warm standby: once an attempt has stepped, the next attempt's ranks are started beside
    # it and wait, prepared, for a failure (a second set of processes per node). False: every
    # relaunch starts cold.
    standby: bool = True
    # With spares, the standby on and MPICH Hydra's mpiexec: prepared ranks (the interpreter
    # started and torch imported, no rank number yet) are kept on every node and spare, one
    # launch per node; a relaunch the standby cannot serve (a lost node, a spare in its place)
    # starts them as its ranks instead of cold processes. False: such a relaunch is cold.
    warm_spare: bool = True
    # A fork template per node (and spare), a launch of its own with torch and the training loop
    # imported: every rank the job starts there (cold, standby, prepared) is forked from it
    # instead of a new interpreter paying the imports again. Needs MPICH Hydra's mpiexec and the
    # project's worker; False: every rank is a new interpreter.
    template: bool = True
    # A node with this many failures attributed to it in this job is excluded (0: never).
    exclude_after: int = 2
    # Without a spare to take an excluded node's place: go on with fewer nodes (a smaller world,
    # the checkpoint resharded), down to min_nodes; false ends the job (exit 6).
    shrink: bool = False
    min_nodes: int = 1


AUTO = "auto"  # a limit learned from the run's own step times and beats (limits.auto_*)
AUTO_PHASES = ("train", "save")  # the phases that recur: "auto" has something to learn from
LEASE_AUTO_S = 10.0  # [heartbeat] lease_s "auto": a rank cut off ends within this...
LEASE_RENEWALS = 4  # ...or this many beat intervals, if longer: a few renewals may come late


@dataclass
class ProgressConfig:
    """Seconds a rank may stay in a phase without its step or phase moving; "auto" (train,
    save): learned from the run, within [heartbeat.auto_max]."""

    init: float | Literal["auto"] = 120.0  # "auto" is refused (check): nothing to learn from
    load: float | Literal["auto"] = 300.0
    train: float | Literal["auto"] = 120.0
    save: float | Literal["auto"] = 600.0


@dataclass
class AutoMaxConfig:
    """The most each "auto" limit may be (seconds); also what it is until learned."""

    timeout_s: float = 10.0
    train: float = 120.0
    save: float = 600.0


@dataclass
class HeartbeatConfig:
    interval_s: float = 1.0
    # Liveness: no message from a rank for this long means it is lost; "auto": learned from
    # the beats' own gaps while the ranks train (within [heartbeat.auto_max], its maximum until
    # learned and outside training). Beats come from a thread of their own, so a slow step does
    # not delay them: a stopped rank is found in about 3 beat intervals instead of 10 s.
    timeout_s: float | Literal["auto"] = AUTO
    # How often the supervisor judges liveness and progress.
    check_s: float = 0.1
    # Where to bind: "auto" is loopback when every node is this host, else all interfaces.
    bind: str = "auto"
    port: int = 0
    # Host name the ranks connect to; "auto": this host's name (loopback when local).
    advertise: str = "auto"
    # One relay per node (local rank 0) sends its node's beats as one summary per interval
    # (supervisor.watch.relays): true, false, or "auto" (on for jobs of 1,024 ranks or more, with
    # more than one rank per node).
    relay: bool | Literal["auto"] = "auto"
    # Fencing (worker.lease): every rank's lease, renewed every interval_s on the control
    # channel; a rank not renewed for this long (cut off, or its supervisor gone) stops writing
    # and ends itself. 0: no lease; "auto": LEASE_AUTO_S, or LEASE_RENEWALS x interval_s if longer.
    lease_s: float | Literal["auto"] = "auto"

    def lease_seconds(self) -> float:
        """The lease in seconds (0: none)."""
        if self.lease_s == "auto":
            return max(LEASE_AUTO_S, LEASE_RENEWALS * self.interval_s)
        return float(self.lease_s)

    progress: ProgressConfig = field(default_factory=ProgressConfig)
    auto_max: AutoMaxConfig = field(default_factory=AutoMaxConfig)


@dataclass
class StragglersConfig:
    """Slow ranks (supervisor.policy.stragglers): each rank's step compute over the job's
    median, judged over a window of observations (about one a heartbeat interval)."""

    enabled: bool = True
    # "report": a `straggler` event; "replace": also, at the next durable checkpoint, a graceful
    # stop and a relaunch with a spare in the slow node's place (or without it, with shrink).
    action: Literal["report", "replace"] = "report"
    # A rank whose median score over the last `window` observations is above this is slow.
    threshold: float = 1.6
    window: int = 10


@dataclass
class GuardConfig:
    """The numerical guard in the ranks (worker.guard): what a bad step (a non-finite loss or
    gradient, or a spike) does. Passed to the worker as its `--guard*` flags (GUARD_FLAGS)."""

    action: Literal["off", "skip", "rollback"] = "skip"
    factor: float = 4.0  # a mean loss above its running baseline x this is a spike
    grad_factor: float = 10.0  # the same for the global gradient norm
    warmup: int = 20  # good steps before spikes are judged; the baseline's window
    skip_batches: int = 1  # rollback: at least this many data positions skipped


# [guard] key -> the [worker] key (worker flag) it is passed as.
GUARD_FLAGS = {
    "action": "guard",
    "factor": "guard_factor",
    "grad_factor": "guard_grad_factor",
    "warmup": "guard_warmup",
    "skip_batches": "guard_skip_batches",
}


def guard_flags(guard: GuardConfig) -> dict[str, Any]:
    """[guard]'s keys that differ from the worker's defaults, as [worker] keys."""
    default = GuardConfig()
    return {
        flag: getattr(guard, key)
        for key, flag in GUARD_FLAGS.items()
        if getattr(guard, key) != getattr(default, key)
    }


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    stragglers: StragglersConfig = field(default_factory=StragglersConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    # [[faults]], parsed (each keeps its table, for the resolved dump); checked again in resolve.
    faults: list[FaultSpec] = field(default_factory=list)
    source: str = "<config>"

    def worker_flags(self) -> list[str]:
        """The worker's command-line flags from [worker], in the table's order."""
        return flags_from_table({**self.worker.flags, **guard_flags(self.guard)})


# --- worker flags ------------------------------------------------------------------------------
def flags_from_table(table: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in table.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            if key in DEFAULT_ON_FLAGS:
                out.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            out += [flag, *(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


# --- the run dir ---------------------------------------------------------------------------------
def expand_run_dir(cfg: Config, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    text = fill_dir(cfg.job.run_dir, cfg.source, "job.run_dir", name=cfg.job.name, time=stamp)
    return Path(text).expanduser().absolute()


def fill_dir(template: str, source: Path, key: str, **values: str) -> str:
    """`template` with its plain {name} and {time} replaced. Anything else in braces (a
    conversion, a format spec, an attribute or index, another name) is refused: str.format
    would call into the value (`{name.__class__}`) or pad it to any width
    (`{name:>999999999}`: a gigabyte before any check of the path)."""
    fix = "use only {name} and {time}, and {{ }} for a literal brace"
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(source, key, f"bad placeholder ({exc}); {fix}") from None
    for _, field_name, spec, conversion in fields:
        if field_name is None:
            continue
        if field_name not in values or spec or conversion:
            text = "{" + field_name + (f"!{conversion}" if conversion else "")
            text += (f":{spec}" if spec else "") + "}"
            raise ConfigError(source, key, f"bad placeholder {text[:40]!r}; {fix}")
    return template.format(**values)
