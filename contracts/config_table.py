"""`ConfigError` and typed reads from TOML tables: the leaf that `config` and `faults.spec` share.

Every failure names the file, the key (`launch.ranks_per_node`, `faults[2].at_step`) and what
was expected, so `validate` and `run` exit 2 with one line. Two ways to read a table, one error:
`build` fills a config dataclass from its type hints (the fixed tables); `Table` reads keys one
by one (tables whose keys depend on each other, like `[[faults]]`). This module imports nothing
of the project, so neither side imports the other.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from typing import Any, Literal, NoReturn


class ConfigError(ValueError):
    """A user error in the config: reported as `file: key: message`, exit status 2."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + message)


def reject_unknown(
    raw: dict[str, Any], known: typing.Sequence[str], prefix: str, source: str, list_known: bool
) -> None:
    """An unknown key is an error, never ignored: name it, suggest the nearest known one."""
    for key in raw:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            message = "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else "")
            if list_known:
                message += "; known: " + ", ".join(known)
            raise ConfigError(source, _join(prefix, key), message)


def _join(prefix: str, key: str) -> str:
    return ".".join(p for p in (prefix, key) if p)


# --- a dataclass from its type hints -------------------------------------------------------------
def build(cls: type, raw: Any, prefix: str, source: str, skip: frozenset | set = frozenset()):
    """An instance of the config dataclass `cls` from `raw`; the `skip` fields are read elsewhere
    (their types are not even looked at, so they may name modules loaded only when needed)."""
    where = prefix.rstrip(".") or cls.__name__
    if not isinstance(raw, dict):
        raise ConfigError(source, where, "expected a table")
    names = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    reject_unknown(raw, names, prefix.rstrip("."), source, list_known=True)
    hints = _hints(cls, names)
    values = {name: convert(raw[name], hints[name], prefix + name, source) for name in names
              if name in raw}  # fmt: skip
    return cls(**values)


def _hints(cls: type, names: list[str]) -> dict[str, Any]:
    """The evaluated type hints of these fields only (what `typing.get_type_hints` does for all)."""
    namespace = vars(sys.modules[cls.__module__])
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in names:
            out[f.name] = eval(f.type, namespace) if isinstance(f.type, str) else f.type  # noqa: S307
    return out


def convert(value: Any, hint: Any, key: str, source: str) -> Any:
    """`value` checked against (and, for numbers and dataclasses, converted to) `hint`."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key + ".", source)
    if origin is Literal:
        if value not in args:
            choices = " | ".join(repr(a) for a in args)
            raise ConfigError(source, key, f"expected one of {choices}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return convert(value, option, key, source)
            except ConfigError:
                continue
        raise ConfigError(source, key, f"expected {_describe(hint)}, got {_show(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected {_describe(hint)}, got {_show(value)}")
        return [convert(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected {_describe(hint)}, got {_show(value)}")
        return {str(k): convert(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, key, f"expected a number, got {_show(value)}")
        return float(value)
    if hint is int:
        if not is_int(value):
            raise ConfigError(source, key, f"expected an integer, got {_show(value)}")
        return value
    if hint is bool or hint is str:
        if not isinstance(value, hint):
            raise ConfigError(source, key, f"expected {_describe(hint)}, got {_show(value)}")
        return value
    if hint is Any:
        return value
    raise TypeError(f"unsupported config type {hint!r}")  # a bug here, not the user's


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a table"
    if origin is Literal:
        return " or ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}.get(
        hint, str(hint)
    )


def _show(value: Any) -> str:
    kind = {str: "string", bool: "boolean", int: "integer", float: "number"}.get(type(value))
    kind = kind or ("list" if isinstance(value, list) else "table")
    return f"{kind} {value!r}" if kind != "table" else "a table"


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --- key by key ---------------------------------------------------------------------------------
class Table:
    """Typed reads from one table; every failure names `prefix.key`."""

    def __init__(self, raw: dict[str, Any], prefix: str, source: str) -> None:
        self.raw, self.prefix, self.source = raw, prefix, source

    def fail(self, key: str, message: str) -> NoReturn:
        raise ConfigError(self.source, _join(self.prefix, key), message)

    def reject_unknown(self, known: typing.Sequence[str]) -> None:
        reject_unknown(self.raw, known, self.prefix, self.source, list_known=False)

    def number(self, key: str, default: float | None = None, positive: bool = False) -> float:
        value = self.raw.get(key, default)
        if value is None:
            self.fail(key, "missing: expected a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"expected a number, got {value!r}")
        if not math.isfinite(value) or (positive and value <= 0):
            self.fail(key, f"expected a {'positive ' if positive else ''}finite number")
        return float(value)

    def numbers(self, key: str, minimum: float) -> list[float]:
        value = self.raw[key]
        if not isinstance(value, list) or not value:
            self.fail(key, "expected a non-empty list of numbers")
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                self.fail(key, f"expected numbers, got {v!r}")
            if v < minimum:
                self.fail(key, f"expected numbers >= {minimum:g}, got {v!r}")
        return [float(v) for v in value]

    def integer(self, key: str, default: int | None, minimum: int | None = None) -> int:
        value = self.raw.get(key, default)
        if value is None:
            self.fail(key, "missing: expected an integer")
        if not is_int(value):
            self.fail(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            self.fail(key, f"expected an integer >= {minimum}, got {value}")
        return value

    def integers(self, key: str, minimum: int) -> list[int]:
        value = self.raw[key]
        if is_int(value):
            value = [value]
        if not isinstance(value, list) or not value or not all(is_int(v) for v in value):
            self.fail(key, "expected a step or a non-empty list of steps")
        if min(value) < minimum:
            self.fail(key, f"expected steps >= {minimum}, got {min(value)}")
        return value

    def count(self) -> int | None:
        if "count" not in self.raw:
            return None
        return self.integer("count", None, minimum=1)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"expected true or false, got {value!r}")
        return value

    def string(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {value!r}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: str | None) -> Any:
        value = self.raw.get(key, default)
        if value is None:
            self.fail(key, "missing: expected one of " + " | ".join(map(repr, choices)))
        if value not in choices:
            self.fail(key, f"expected one of {' | '.join(map(repr, choices))}, got {value!r}")
        return value
