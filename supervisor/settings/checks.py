"""Why a config's values cannot work: the semantic checks that run once its tables parsed (job
name, nodes, launcher, restart and heartbeat limits), the `[worker]` keys against the worker's
own spec, and the value rules they share (a job name, a host name, NUL bytes, duplicates).
Each raises a ConfigError naming the key, or says the problem as text."""

from __future__ import annotations

import difflib
import math
import re
from typing import Any

from contracts import scratch
from contracts.config_table import ConfigError
from supervisor.settings import worker_spec
from supervisor.settings.config import (
    AUTO,
    AUTO_PHASES,
    GUARD_FLAGS,
    LEASE_RENEWALS,
    Config,
    flags_from_table,
    guard_flags,
)
from supervisor.settings.launcher_kinds import FLAVOR_EMULATES, KIND_FACTS

PHASE_NAMES = ("init", "load", "train", "save")
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
MIN_BEAT_S = 0.01  # a faster heartbeat is a busy loop in every rank


# --- [worker] against the worker's spec ----------------------------------------------------------
def check_worker_keys(cfg: Config) -> None:
    """Every `[worker]` key is a flag of the worker (a switch given true/false, a value flag a
    value) and the worker's own parser takes the values (its spec: `worker_spec`). A worker
    module without a spec has its flags passed as given."""
    spec = spec_of(cfg)
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


def spec_of(cfg: Config) -> worker_spec.WorkerSpec | None:
    """`worker.module`'s spec (None: it has none); ConfigError where it cannot be imported."""
    try:
        return worker_spec.load(cfg.worker.module)
    except worker_spec.SpecError as exc:
        raise ConfigError(cfg.source, "worker.module", str(exc)) from None


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
    launch = cfg.launch
    launcher = KIND_FACTS[launch.launcher]
    need(launch.ranks_per_node >= 1, "launch.ranks_per_node", "expected an integer >= 1")
    need(
        launch.ranks_per_node <= MAX_RANKS_PER_NODE,
        "launch.ranks_per_node",
        f"expected at most {MAX_RANKS_PER_NODE} (one rank per accelerator or core), "
        f"got {launch.ranks_per_node}",
    )
    if isinstance(launch.nodes, str):
        need(launch.nodes == "auto", "launch.nodes", 'expected "auto" or a list of host names')
    else:
        need(len(launch.nodes) >= 1, "launch.nodes", "expected at least one host name")
        for i, node in enumerate(launch.nodes):
            problem = host_problem(node)
            need(problem is None, f"launch.nodes[{i}]", str(problem))
        twice = duplicates([node.lower() for node in launch.nodes])  # host names ignore case
        need(
            not twice,
            "launch.nodes",
            f"{', '.join(map(repr, twice))} named more than once; name each node once "
            "(ranks_per_node says how many ranks each runs)",
        )
        need(not launch.hostfile, "launch.hostfile", "give either launch.nodes or launch.hostfile")
    for name in launch.env:
        need(
            bool(_ENV_NAME.fullmatch(name)),
            f"launch.env.{name}",
            f"{name!r} is not an environment variable name: expected letters, digits and "
            '"_", not starting with a digit (e.g. OMP_NUM_THREADS)',
        )
    for i, arg in enumerate(launch.args):
        need(bool(arg), f"launch.args[{i}]", "expected a launcher argument, got an empty string")
    if launcher.this_host_only:
        need(not launch.hostfile, "launch.hostfile", "the local launcher runs on this host only")
    need(launch.spares >= 0, "launch.spares", "expected an integer >= 0")
    if launch.emulate_nodes:
        need(
            launcher.emulates_nodes and FLAVOR_EMULATES.get(launch.flavor, False),
            "launch.emulate_nodes",
            'emulated nodes need MPICH\'s mpiexec (launcher = "mpiexec", flavor hydra)',
        )
        need(
            isinstance(launch.nodes, list),
            "launch.nodes",
            'emulate_nodes names its nodes: give a list, e.g. nodes = ["n0", "n1", "n2"]',
        )
    if isinstance(launch.nodes, list):
        need(
            launch.spares < len(launch.nodes),
            "launch.spares",
            f"expected fewer spares than nodes ({len(launch.nodes)}), got {launch.spares}",
        )
    restart = cfg.restart
    need(restart.exclude_after >= 0, "restart.exclude_after", "expected an integer >= 0 (0: never)")
    need(restart.min_nodes >= 1, "restart.min_nodes", "expected an integer >= 1")
    if isinstance(launch.nodes, list):
        active = len(launch.nodes) - launch.spares
        need(
            restart.min_nodes <= active,
            "restart.min_nodes",
            f"expected at most the {active} node(s) the job starts on, got {restart.min_nodes}",
        )
    need(restart.max_restarts >= 0, "restart.max_restarts", "expected an integer >= 0")
    need(len(restart.backoff_s) >= 1, "restart.backoff_s", "expected at least one delay")
    for i, d in enumerate(restart.backoff_s):
        need(_finite(d) and d >= 0, f"restart.backoff_s[{i}]", "expected a delay >= 0 seconds")
    need(restart.min_progress_steps >= 1, "restart.min_progress_steps", "expected an integer >= 1")
    need(restart.max_same_resume >= 2, "restart.max_same_resume", "expected an integer >= 2")
    for name in ("teardown_grace_s", "stop_grace_s"):
        v = getattr(restart, name)
        need(_finite(v) and v >= 0, f"restart.{name}", "expected seconds >= 0")
    heartbeat = cfg.heartbeat
    need(
        _finite(heartbeat.interval_s) and heartbeat.interval_s >= MIN_BEAT_S,
        "heartbeat.interval_s",
        _got(
            f"seconds >= {MIN_BEAT_S:g} (every rank beats this often)", heartbeat.interval_s, False
        ),
    )
    for key in ("bind", "advertise"):
        need(
            bool(getattr(heartbeat, key).strip()),
            f"heartbeat.{key}",
            'expected "auto" or a host name or address, got an empty string',
        )
    twice = f"at least twice interval_s ({2 * heartbeat.interval_s:g} s)"
    if heartbeat.timeout_s != AUTO:
        need(
            _finite(heartbeat.timeout_s) and heartbeat.timeout_s >= 2 * heartbeat.interval_s,
            "heartbeat.timeout_s",
            _got(twice, heartbeat.timeout_s),
        )
    v = heartbeat.auto_max.timeout_s
    need(
        _finite(v) and v >= 2 * heartbeat.interval_s,
        "heartbeat.auto_max.timeout_s",
        _got(twice, v, auto=False),
    )
    need(
        _finite(heartbeat.check_s) and 0 < heartbeat.check_s <= 5,
        "heartbeat.check_s",
        "expected 0 < s <= 5",
    )
    need(0 <= heartbeat.port <= 65535, "heartbeat.port", "expected 0 (any) or a port number")
    lease = heartbeat.lease_s
    if lease != AUTO:
        need(
            _finite(lease) and (lease == 0 or lease >= LEASE_RENEWALS * heartbeat.interval_s),
            "heartbeat.lease_s",
            _got(
                f"0 (no lease) or seconds >= {LEASE_RENEWALS} x interval_s "
                f"({LEASE_RENEWALS * heartbeat.interval_s:g} s: renewed every interval_s, a few "
                "may be late)",
                lease,
            ),
        )
    more = f"seconds > interval_s ({heartbeat.interval_s:g})"
    for phase in PHASE_NAMES:
        v = getattr(heartbeat.progress, phase)
        key = f"heartbeat.progress.{phase}"
        if v == AUTO:
            need(
                phase in AUTO_PHASES,
                key,
                f'"auto" is for {" and ".join(AUTO_PHASES)} (phases that recur, so there is '
                f"something to learn from); {phase} comes once an attempt: give {more}",
            )
            continue
        need(_finite(v) and v > heartbeat.interval_s, key, _got(more, v))
    for phase in AUTO_PHASES:
        v = getattr(heartbeat.auto_max, phase)
        need(
            _finite(v) and v > heartbeat.interval_s,
            f"heartbeat.auto_max.{phase}",
            _got(more, v, auto=False),
        )
    check_stragglers(cfg)
    check_guard(cfg)


def check_stragglers(cfg: Config) -> None:
    """[stragglers]: a threshold above a typical rank's score (1.0) and a window to judge over."""
    st = cfg.stragglers
    if not (_finite(st.threshold) and st.threshold > 1):
        raise ConfigError(
            cfg.source,
            "stragglers.threshold",
            f"expected a score > 1 (a rank's compute over the median; 1.0 is typical), "
            f"got {st.threshold!r}",
        )
    if not 2 <= st.window <= 1000:
        raise ConfigError(
            cfg.source,
            "stragglers.window",
            f"expected 2 to 1000 observations (steps, as a rule), got {st.window}",
        )


def no_durable_checkpoints(cfg: Config) -> bool:
    """Whether the job's worker, by its flags, makes no periodic durable checkpoint (ours with
    `save_interval` 0, its default): a straggler's replacement, due at the next one, never
    comes. A worker without a spec that knows `save_interval` is taken to make them."""
    spec = spec_of(cfg)
    if spec is None or "save_interval" not in spec.flag_kinds():
        return False
    every = cfg.worker.flags.get("save_interval", 0)
    return isinstance(every, int) and not isinstance(every, bool) and every <= 0


def check_guard(cfg: Config) -> None:
    """[guard]: factors above 1, a warm-up and a skip of at least 1; a key set both here and as
    its [worker] flag is one value too many."""
    g = cfg.guard
    for key in ("factor", "grad_factor"):
        value = getattr(g, key)
        if not (_finite(value) and value > 1):
            raise ConfigError(
                cfg.source,
                f"guard.{key}",
                f"expected a number above 1 (x the baseline), got {value!r}",
            )
    for key in ("warmup", "skip_batches"):
        if getattr(g, key) < 1:
            raise ConfigError(
                cfg.source, f"guard.{key}", f"expected 1 or more, got {getattr(g, key)}"
            )
    if g.skip_batches > 10**9:  # the worker's bound (worker.guard.MAX_SKIP_BATCHES)
        raise ConfigError(
            cfg.source, "guard.skip_batches", f"expected at most 10^9, got {g.skip_batches}"
        )
    for key, flag in GUARD_FLAGS.items():
        if flag in cfg.worker.flags and flag in guard_flags(g):
            raise ConfigError(
                cfg.source,
                f"worker.{flag}",
                f"set twice: keep guard.{key} or worker.{flag}, not both",
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
