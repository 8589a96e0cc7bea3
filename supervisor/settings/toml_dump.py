"""The resolved config written back as TOML (the run dir's config.toml, `--dry-run`): a
`Config` as plain tables (`to_dict`) and the TOML text of such tables (`dumps`)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from supervisor.settings.config import Config


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
