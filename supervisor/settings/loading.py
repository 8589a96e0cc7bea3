"""A job config read: the TOML file, `--set` overrides, the tables built strictly into a
`Config`, then the checks in order of dependence. Every error names the file, the key and what
was expected, so `validate` and `run` can exit 2 with one line and launch nothing. Unknown keys
are errors (with a suggestion), never ignored.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contracts.config_table import ConfigError, build, reject_unknown
from supervisor.settings.checks import check, check_worker_keys, nul_problem
from supervisor.settings.config import Config, WorkerConfig

if TYPE_CHECKING:  # faults/ is imported only for a config that declares [[faults]]
    from faults import FaultSpec

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    sys.exit("elastic-supervisor needs Python 3.11 or newer (for tomllib)")

_FLAG_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# The tables of a job config, in the order the README shows them.
TABLES = ("job", "launch", "worker", "restart", "heartbeat", "stragglers", "guard", "faults")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


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


def _faults(raw: Any, source: str, cfg: Config) -> list[FaultSpec]:
    """[[faults]] as typed specs, checked against what the config says of the job (its world,
    when the nodes are "auto", is checked again once resolved)."""
    if isinstance(raw, list) and not raw:
        return []
    from faults import parse_all, shape_of  # faults/ is loaded only for a fault schedule

    return parse_all(raw, source, shape_of(cfg))
