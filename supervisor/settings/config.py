"""The job's TOML config: typed dataclasses, strict loading, `--set` overrides, resolved dump.

Every error names the file, the key and what was expected, so `validate` and `run` can exit 2
with one line and launch nothing. Unknown keys are errors (with a suggestion), never ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from contracts import scratch
from contracts.config_table import ConfigError, build, reject_unknown
from supervisor.settings import worker_spec

if TYPE_CHECKING:  # faults/ is imported only for a config that declares [[faults]]
    from faults.spec import FaultSpec

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    sys.exit("elastic-supervisor needs Python 3.11 or newer (for tomllib)")

LAUNCHERS = ("mpiexec", "srun", "local")
FLAVORS = ("auto", "hydra", "pals")
PHASE_NAMES = ("init", "load", "train", "save")
# Worker flags that default on: `key = false` becomes `--no-key` (argparse BooleanOptionalAction).
# Any other `key = false` is left out, `key = true` becomes `--key`.
DEFAULT_ON_FLAGS = frozenset({"save_on_exit"})
_FLAG_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
DEFAULT_MODULE = "worker.train"
# The tables of a job config, in the order the README shows them.
TABLES = ("job", "launch", "worker", "restart", "heartbeat", "faults")
# A job name becomes a path component (the run dir's {name}, the memory tier's and the stage
# dir's names) and part of ES_JOB_ID, so it is a plain name: no separators, nothing to quote.
NAME_MAX = scratch.JOB_NAME_MAX
NAME_CHARS = 'ASCII letters, digits, ".", "_" and "-"'
_NAME = scratch.JOB_NAME
# A node name goes into host files (`host:n`, `#` comments), Hydra's comma lists and ssh.
HOST_MAX = 253
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# What execve and a POSIX shell take as an environment variable name.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_RANKS_PER_NODE = 4096
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
MIN_BEAT_S = 0.01  # a faster heartbeat is a busy loop in every rank


@dataclass
class JobConfig:
    name: str = "job"
    # `{name}` and `{time}` (UTC, YYYYmmdd-HHMMSS) are expanded once, at start.
    run_dir: str = "runs/{name}-{time}"


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
    # A node with this many failures attributed to it in this job is excluded (0: never).
    exclude_after: int = 2
    # Without a spare to take an excluded node's place: go on with fewer nodes (a smaller world,
    # the checkpoint resharded), down to min_nodes; false ends the job (exit 6).
    shrink: bool = False
    min_nodes: int = 1


AUTO = "auto"  # a limit learned from the run's own step times and beats (decisions.auto_*)
AUTO_PHASES = ("train", "save")  # the phases that recur: "auto" has something to learn from


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
    # the beats' own gaps while the ranks train (within [heartbeat.auto_max]).
    timeout_s: float | Literal["auto"] = 10.0
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
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    auto_max: AutoMaxConfig = field(default_factory=AutoMaxConfig)


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    # [[faults]], parsed (each keeps its table, for the resolved dump); checked again in resolve.
    faults: list[FaultSpec] = field(default_factory=list)
    source: str = "<config>"

    def worker_flags(self) -> list[str]:
        """The worker's command-line flags from [worker], in the table's order."""
        return flags_from_table(self.worker.flags)


# --- loading ------------------------------------------------------------------------------------
def load(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, override, and check a config file; raise ConfigError on any user error."""
    source = str(path)
    raw = parse_toml_file(path)
    for item in overrides or []:
        apply_override(raw, item, source)
    try:
        return from_dict(raw, source)
    except ConfigError as exc:
        raise with_faults_hint(exc, overrides) from None


def with_faults_hint(exc: ConfigError, overrides: list[str] | None) -> ConfigError:
    """A `--set` that leaves a fault out of reach (`--set worker.train_iters=50` on the demo)
    is told how to drop the faults too."""
    if overrides and exc.key.startswith("faults[") and "never reached" in exc.message:
        return ConfigError(exc.source, exc.key, f"{exc.message}; or drop them: --set 'faults=[]'")
    return exc


def parse_toml_file(path: str | Path) -> dict[str, Any]:
    """The file's TOML tables, or a ConfigError that says in one line why it can't be read."""
    source = str(path)
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(source, "", "no such file") from None
    except IsADirectoryError:
        raise ConfigError(source, "", "is a directory, expected a TOML file") from None
    except PermissionError:
        raise ConfigError(source, "", "permission denied: make it readable (chmod +r)") from None
    except OSError as exc:
        raise ConfigError(source, "", f"cannot be read: {exc.strerror or exc}") from None
    if not data.strip():
        raise ConfigError(source, "", "is empty; expected a job config (configs/debug.toml is one)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"byte {exc.start}"
        raise ConfigError(source, "", f"not UTF-8 text at {where} (a binary file?)") from None
    if "\0" in text:
        raise ConfigError(source, "", "not a text file (it holds NUL bytes)")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None


def apply_override(raw: dict[str, Any], item: str, source: str = "--set") -> None:
    """`key.sub=value`: value is read as a TOML value, else taken as a plain string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("--set", item, "expected key.sub=value")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    table = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        nxt = table.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError("--set", ".".join(parts[: i + 1]), "is not a table")
        table = nxt
    table[parts[-1]] = value


def from_dict(raw: dict[str, Any], source: str = "<config>") -> Config:
    """A checked Config. The checks run in the order of dependence, so the first error is the
    real mistake: a misspelt table or key before the values, the values before the faults that
    are checked against them (a `save_intervl` typo is named as such, not as a fault that
    finds no checkpoints)."""
    raw = dict(raw)
    if isinstance(raw.get("experiment"), dict):
        raise ConfigError(
            source,
            "experiment",
            "an experiment config: run it with `python -m supervisor experiment CONFIG` "
            "(`validate` and `experiment --dry-run` check it)",
        )
    reject_unknown(raw, TABLES, "", source, list_known=True)
    nul = nul_problem(raw)
    if nul:
        why = "holds a NUL byte (\\u0000), which no path, argument or environment value can carry"
        raise ConfigError(source, nul, why)
    worker_raw = raw.pop("worker", {})
    faults = raw.pop("faults", [])
    cfg = build(Config, raw, "", source, skip={"worker", "faults", "source"})
    cfg.source = source
    cfg.worker = _worker(worker_raw, source)
    check_worker_keys(cfg)
    check(cfg)
    cfg.faults = _faults(faults, source, cfg)
    return cfg


def _worker(raw: Any, source: str) -> WorkerConfig:
    if not isinstance(raw, dict):
        raise ConfigError(source, "worker", "expected a table")
    raw = dict(raw)
    module = raw.pop("module", "worker.train")
    if not isinstance(module, str) or not _MODULE.fullmatch(module):
        shown = module if isinstance(module, str) else repr(module)
        raise ConfigError(
            source,
            "worker.module",
            f"expected a Python module name (`python -m NAME`), got {shown!r}",
        )
    for key, value in raw.items():
        where = f"worker.{key}"
        if not _FLAG_NAME.match(key):
            raise ConfigError(source, where, "expected a flag name in snake_case")
        scalar = (str, int, float, bool)
        if isinstance(value, list):
            if not all(isinstance(v, scalar) and not isinstance(v, bool) for v in value):
                raise ConfigError(source, where, "expected a list of strings or numbers")
        elif not isinstance(value, scalar):
            raise ConfigError(source, where, "expected a string, number, boolean or list")
    return WorkerConfig(module=module, flags=raw)


def check_worker_keys(cfg: Config) -> None:
    """Every `[worker]` key is a flag of the worker (a switch given true/false, a value flag a
    value) and the worker's own parser takes the values (its spec: `worker_spec`). A worker
    module without a spec has its flags passed as given."""
    spec = worker_spec.load(cfg.worker.module)
    if spec is None:
        return
    kinds = spec.flag_kinds()
    for key, value in cfg.worker.flags.items():
        problem = worker_key_problem(key, value, kinds, cfg.worker.module)
        if problem:
            raise ConfigError(cfg.source, f"worker.{key}", problem)
    resolved = {"ckpt_dir": "{run_dir}/ckpt", **cfg.worker.flags}  # resolve's default
    refusal = spec.flags_problem(flags_from_table(resolved))
    if refusal is not None:
        raise worker_error(cfg, refusal)


def worker_error(cfg: Config, message: str) -> ConfigError:
    """The worker's own one-line refusal as a ConfigError on the `[worker]` key it names."""
    flag = {k: "--" + k.replace("_", "-") for k in cfg.worker.flags}
    named = [
        (message.find(f), k) for k, f in flag.items() if re.search(re.escape(f) + r"\b", message)
    ]
    where = f"worker.{min(named)[1]}" if named else "worker"
    return ConfigError(cfg.source, where, f"{message} (the worker's own check)")


def worker_key_problem(key: str, value: object, kinds: dict[str, bool], module: str) -> str | None:
    """Why `key = value` is no flag of the worker `module` (None: it is); `kinds`: flag -> is a
    switch."""
    flag = "--" + key.replace("_", "-")
    if key not in kinds:
        close = difflib.get_close_matches(key, list(kinds), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]} (--{close[0].replace('_', '-')})?" if close else ""
        return f"the worker has no flag {flag}{hint} (python -m {module} --help)"
    if kinds[key] and not isinstance(value, bool):
        return f"{flag} is a switch: expected true or false"
    if not kinds[key] and isinstance(value, bool):
        return f"{flag} takes a value, not {str(value).lower()}"
    return None


def _faults(raw: Any, source: str, cfg: Config) -> list[FaultSpec]:
    """[[faults]] as typed specs, checked against what the config says of the job (its world,
    when the nodes are "auto", is checked again once resolved)."""
    if isinstance(raw, list) and not raw:
        return []
    from faults.spec import parse_all, shape_of  # faults/ is loaded only for a fault schedule

    return parse_all(raw, source, shape_of(cfg))


# --- semantic checks ------------------------------------------------------------------------------
def check(cfg: Config) -> None:
    """Values that parse but cannot work."""
    src = cfg.source

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(src, key, message)

    problem = name_problem(cfg.job.name)
    need(problem is None, "job.name", str(problem))
    need(bool(cfg.job.run_dir.strip()), "job.run_dir", "expected a directory path")
    la = cfg.launch
    need(la.ranks_per_node >= 1, "launch.ranks_per_node", "expected an integer >= 1")
    need(
        la.ranks_per_node <= MAX_RANKS_PER_NODE,
        "launch.ranks_per_node",
        f"expected at most {MAX_RANKS_PER_NODE} (one rank per accelerator or core), "
        f"got {la.ranks_per_node}",
    )
    if isinstance(la.nodes, str):
        need(la.nodes == "auto", "launch.nodes", 'expected "auto" or a list of host names')
    else:
        need(len(la.nodes) >= 1, "launch.nodes", "expected at least one host name")
        for i, node in enumerate(la.nodes):
            problem = host_problem(node)
            need(problem is None, f"launch.nodes[{i}]", str(problem))
        twice = duplicates([node.lower() for node in la.nodes])  # host names ignore case
        need(
            not twice,
            "launch.nodes",
            f"{', '.join(map(repr, twice))} named more than once; name each node once "
            "(ranks_per_node says how many ranks each runs)",
        )
        need(not la.hostfile, "launch.hostfile", "give either launch.nodes or launch.hostfile")
    for name in la.env:
        need(
            bool(_ENV_NAME.fullmatch(name)),
            f"launch.env.{name}",
            f"{name!r} is not an environment variable name: expected letters, digits and "
            '"_", not starting with a digit (e.g. OMP_NUM_THREADS)',
        )
    for i, arg in enumerate(la.args):
        need(bool(arg), f"launch.args[{i}]", "expected a launcher argument, got an empty string")
    if la.launcher == "local":
        need(not la.hostfile, "launch.hostfile", "the local launcher runs on this host only")
    need(la.spares >= 0, "launch.spares", "expected an integer >= 0")
    if la.emulate_nodes:
        need(
            la.launcher == "mpiexec" and la.flavor != "pals",
            "launch.emulate_nodes",
            'emulated nodes need MPICH\'s mpiexec (launcher = "mpiexec", flavor hydra)',
        )
        need(
            isinstance(la.nodes, list),
            "launch.nodes",
            'emulate_nodes names its nodes: give a list, e.g. nodes = ["n0", "n1", "n2"]',
        )
    if isinstance(la.nodes, list):
        need(
            la.spares < len(la.nodes),
            "launch.spares",
            f"expected fewer spares than nodes ({len(la.nodes)}), got {la.spares}",
        )
    rs = cfg.restart
    need(rs.exclude_after >= 0, "restart.exclude_after", "expected an integer >= 0 (0: never)")
    need(rs.min_nodes >= 1, "restart.min_nodes", "expected an integer >= 1")
    if isinstance(la.nodes, list):
        active = len(la.nodes) - la.spares
        need(
            rs.min_nodes <= active,
            "restart.min_nodes",
            f"expected at most the {active} node(s) the job starts on, got {rs.min_nodes}",
        )
    need(rs.max_restarts >= 0, "restart.max_restarts", "expected an integer >= 0")
    need(len(rs.backoff_s) >= 1, "restart.backoff_s", "expected at least one delay")
    for i, d in enumerate(rs.backoff_s):
        need(_finite(d) and d >= 0, f"restart.backoff_s[{i}]", "expected a delay >= 0 seconds")
    need(rs.min_progress_steps >= 1, "restart.min_progress_steps", "expected an integer >= 1")
    need(rs.max_same_resume >= 2, "restart.max_same_resume", "expected an integer >= 2")
    for name in ("teardown_grace_s", "stop_grace_s"):
        v = getattr(rs, name)
        need(_finite(v) and v >= 0, f"restart.{name}", "expected seconds >= 0")
    hb = cfg.heartbeat
    need(
        _finite(hb.interval_s) and hb.interval_s >= MIN_BEAT_S,
        "heartbeat.interval_s",
        _got(f"seconds >= {MIN_BEAT_S:g} (every rank beats this often)", hb.interval_s, False),
    )
    for key in ("bind", "advertise"):
        need(
            bool(getattr(hb, key).strip()),
            f"heartbeat.{key}",
            'expected "auto" or a host name or address, got an empty string',
        )
    twice = f"at least twice interval_s ({2 * hb.interval_s:g} s)"
    if hb.timeout_s != AUTO:
        need(
            _finite(hb.timeout_s) and hb.timeout_s >= 2 * hb.interval_s,
            "heartbeat.timeout_s",
            _got(twice, hb.timeout_s),
        )
    v = hb.auto_max.timeout_s
    need(
        _finite(v) and v >= 2 * hb.interval_s,
        "heartbeat.auto_max.timeout_s",
        _got(twice, v, auto=False),
    )
    need(_finite(hb.check_s) and 0 < hb.check_s <= 5, "heartbeat.check_s", "expected 0 < s <= 5")
    need(0 <= hb.port <= 65535, "heartbeat.port", "expected 0 (any) or a port number")
    more = f"seconds > interval_s ({hb.interval_s:g})"
    for phase in PHASE_NAMES:
        v = getattr(hb.progress, phase)
        key = f"heartbeat.progress.{phase}"
        if v == AUTO:
            need(
                phase in AUTO_PHASES,
                key,
                f'"auto" is for {" and ".join(AUTO_PHASES)} (phases that recur, so there is '
                f"something to learn from); {phase} comes once an attempt: give {more}",
            )
            continue
        need(_finite(v) and v > hb.interval_s, key, _got(more, v))
    for phase in AUTO_PHASES:
        v = getattr(hb.auto_max, phase)
        need(
            _finite(v) and v > hb.interval_s,
            f"heartbeat.auto_max.{phase}",
            _got(more, v, auto=False),
        )


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a job (None: it can): it becomes a path component and part of
    ES_JOB_ID, so no separators, no `..`, nothing a shell or a file system treats specially."""
    shown = name if len(name) <= 40 else name[:40] + "…"
    if not name:
        return f"expected a name: 1 to {NAME_MAX} {NAME_CHARS}"
    if len(name) > NAME_MAX:
        return f"expected at most {NAME_MAX} characters, got {len(name)} ({shown!r})"
    if not _NAME.fullmatch(name) or ".." in name:
        return (
            f'expected {NAME_CHARS}, starting with a letter or digit and without ".." '
            f"(it becomes part of paths), got {shown!r}"
        )
    return None


def host_problem(name: str) -> str | None:
    """Why `name` cannot be a node's host name (None: it can): it goes into host files,
    Hydra's comma-separated lists and ssh."""
    shown = name if len(name) <= 40 else name[:40] + "…"
    if not _HOST.fullmatch(name) or len(name) > HOST_MAX:
        return (
            f'expected a host name (letters, digits, ".", "_" and "-", at most '
            f"{HOST_MAX}), got {shown!r}"
        )
    return None


def duplicates(items: list[str]) -> list[str]:
    """The items given more than once, in the order of their second appearance."""
    seen: set[str] = set()
    out: list[str] = []
    for item in items:
        if item in seen and item not in out:
            out.append(item)
        seen.add(item)
    return out


def nul_problem(value: Any, key: str = "") -> str | None:
    """The first key (`launch.env.A`, `launch.args[2]`) whose name or string holds a NUL byte,
    which no path, argument or environment variable can carry; None when none does."""
    if isinstance(value, str):
        return key if "\0" in value else None
    if isinstance(value, dict):
        items = [(f"{key}.{k}" if key else str(k), k, v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{key}[{i}]", "", v) for i, v in enumerate(value)]
    else:
        return None
    for where, name, v in items:
        found = where if "\0" in name else nul_problem(v, where)
        if found:
            return found
    return None


def _got(expected: str, v: Any, auto: bool = True) -> str:
    what = f'"auto" or {expected}' if auto else expected
    return f"expected {what}, got {v:g}" if _finite(v) else f"expected {what}, got {v!r}"


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


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


# --- resolution and dump -------------------------------------------------------------------------
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


def to_dict(cfg: Config) -> dict[str, Any]:
    d = dataclasses.asdict(dataclasses.replace(cfg, faults=[]))
    d.pop("source")
    worker = d.pop("worker")
    d["worker"] = {"module": worker["module"], **worker["flags"]}
    d.pop("faults")
    if cfg.faults:  # the tables as given
        d["faults"] = [dict(spec.table) for spec in cfg.faults]
    return d


def dumps(data: dict[str, Any]) -> str:
    """TOML text for the resolved config (tables, arrays of tables, scalars, lists)."""
    lines: list[str] = []
    _dump_table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _dump_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not _is_table(v) and not _is_table_list(v)}
    if path and (scalars or not any(_is_table(v) for v in table.values())):
        lines += ["", f"[{'.'.join(_key(p) for p in path)}]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in scalars.items()]
    for k, v in table.items():
        if _is_table(v):
            _dump_table(v, [*path, k], lines)
        elif _is_table_list(v):
            for item in v:
                lines += ["", f"[[{'.'.join(_key(p) for p in [*path, k])}]]"]
                lines += [f"{_key(ik)} = {_value(iv)}" for ik, iv in item.items()]


def _is_table(v: Any) -> bool:
    return isinstance(v, dict)


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(i, dict) for i in v)


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _string(k)


def _string(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return "nan" if math.isnan(v) else repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(i) for i in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(i)}" for k, i in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
