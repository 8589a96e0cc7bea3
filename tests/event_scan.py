"""The events the supervisor's code emits, read with `ast` (nothing runs): every
`emit("name", ...)` and `EventToEmit("name", {...})`, its keywords and the keys of what it
spreads (`**fields`), followed into the dicts a name was built from in its function, into the
functions that return them (their `**extra` bound to the caller's keywords) and into a
function's callers for a parameter. What it cannot follow it is told (`Hand`), or it says so
(`Scan.unresolved`). tests/unit/test_event_fields.py holds docs/architecture.md to it."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import REPO


class Unresolved(Exception):
    """An expression whose keys the scan cannot follow."""


@dataclass
class Function:
    path: Path
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.node.name}"


def _own_nodes(func: ast.AST):
    """The nodes of a function's body, not those of functions defined inside it."""
    todo = list(ast.iter_child_nodes(func))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _is_text(expr: ast.expr) -> bool:
    if isinstance(expr, ast.IfExp):
        return _is_text(expr.body) and _is_text(expr.orelse)
    return isinstance(expr, ast.Constant) and isinstance(expr.value, str)


def _constants(expr: ast.expr, context: str) -> set[str]:
    """The strings an expression of string constants can be (`"a" if x else "b"`)."""
    if not _is_text(expr):
        raise Unresolved(context or ast.unparse(expr))
    if isinstance(expr, ast.IfExp):
        return _constants(expr.body, context) | _constants(expr.orelse, context)
    return {expr.value}


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


@dataclass(frozen=True)
class Ref:
    """Where keys come from that the scan cannot reach by itself: in the function `where`
    (`path:name`), a local `name`, the first argument of its calls to `call`, the values it
    passes as `keyword=`, or (none of them) what it returns."""

    where: str
    name: str | None = None
    call: str | None = None
    keyword: str | None = None


@dataclass
class Hand:
    """What the scan is told by hand (see tests/unit/test_event_fields.py): where each emit's
    event names and keys come from where it cannot follow them, the events built in one
    function and emitted by another, and the functions whose emits are read elsewhere."""

    named: dict[tuple[str, str], tuple[dict[str, tuple[str, ...]], str]]
    keys: dict[tuple[str, str], tuple[Ref, str]]
    built: list[tuple[str, Ref, str]]
    elsewhere: set[str]


@dataclass
class Scan:
    sources: list[Path]
    also_defined: list[Path]  # read for the functions they define; their emits are not
    hand: Hand
    functions: list[Function] = field(default_factory=list)
    by_name: dict[str, list[Function]] = field(default_factory=dict)
    calls: dict[str, list[tuple[ast.Call, Function]]] = field(default_factory=dict)
    emitted: dict[str, set[str]] = field(default_factory=dict)  # event -> fields
    unresolved: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for path in [*self.sources, *self.also_defined]:
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = Function(path, node)
                    self.functions.append(fn)
                    self.by_name.setdefault(node.name, []).append(fn)
        for fn in self.functions:
            for node in _own_nodes(fn.node):
                if isinstance(node, ast.Call) and (name := _call_name(node)):
                    self.calls.setdefault(name, []).append((node, fn))

    # --- the keys of an expression ----------------------------------------------------------
    def keys(self, expr: ast.expr, fn: Function, bound: dict[str, set[str]], depth=0) -> set[str]:
        if depth > 12:
            raise Unresolved("too deep")
        k = lambda e, f=fn, b=bound: self.keys(e, f, b, depth + 1)  # noqa: E731
        by_hand = self.hand.keys.get((fn.where, ast.unparse(expr)))
        if by_hand is not None:
            return self.ref_keys(by_hand[0], depth)
        if isinstance(expr, ast.Dict):
            out: set[str] = set()
            for key, value in zip(expr.keys, expr.values, strict=True):
                if key is None:
                    out |= k(value)
                else:
                    out |= _constants(key, ast.unparse(expr))
            return out
        if isinstance(expr, ast.DictComp):
            (gen,) = expr.generators
            if (
                isinstance(gen.iter, (ast.Tuple, ast.List, ast.Set))
                and isinstance(gen.target, ast.Name)
                and isinstance(expr.key, ast.Name)
                and expr.key.id == gen.target.id
            ):
                return {e.value for e in gen.iter.elts if isinstance(e, ast.Constant)}
            raise Unresolved(ast.unparse(expr))
        if isinstance(expr, ast.IfExp):
            return k(expr.body) | k(expr.orelse)
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            return k(expr.left) | k(expr.right)
        if isinstance(expr, ast.Name):
            return self.name_keys(expr.id, fn, bound, depth)
        if isinstance(expr, ast.Call):
            return self.call_keys(expr, fn, bound, depth)
        raise Unresolved(ast.unparse(expr))

    def name_keys(self, name: str, fn: Function, bound, depth) -> set[str]:
        if name in bound:
            return bound[name]
        args = fn.node.args
        if args.kwarg is not None and args.kwarg.arg == name:
            return self.kwarg_keys(fn, depth)
        params = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
        if name in params:
            return self.param_keys(fn, name, depth)
        out: set[str] = set()
        found = False
        for node in _own_nodes(fn.node):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value:
                if _is_text(node.value):
                    continue  # the same name holds an event's name elsewhere (`said`)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    elts = t.elts if isinstance(t, ast.Tuple) else [t]
                    for i, one in enumerate(elts):
                        if isinstance(one, ast.Name) and one.id == name:
                            if isinstance(t, ast.Tuple):
                                out |= self.item_keys(node.value, i, fn, depth + 1)
                            else:
                                out |= self.keys(node.value, fn, bound, depth + 1)
                            found = True
                        if (
                            isinstance(one, ast.Subscript)
                            and isinstance(one.value, ast.Name)
                            and one.value.id == name
                        ):
                            if not isinstance(one.slice, ast.Constant):
                                raise Unresolved(ast.unparse(one))
                            out.add(one.slice.value)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == name
                and node.func.attr in ("update", "setdefault")
            ):
                if node.func.attr == "setdefault":
                    out.add(node.args[0].value)
                else:
                    out |= {kw.arg for kw in node.keywords if kw.arg}
                    for a in node.args:
                        out |= self.keys(a, fn, bound, depth + 1)
        if not found:
            raise Unresolved(f"{name} in {fn.where}")
        return out

    def item_keys(self, expr: ast.expr, i: int, fn: Function, depth) -> set[str]:
        """The keys of item `i` of a tuple: `value, basis = got`."""
        if depth > 12:
            raise Unresolved("too deep")
        if isinstance(expr, ast.Tuple):
            return self.keys(expr.elts[i], fn, {}, depth + 1)
        if isinstance(expr, ast.Call):
            out: set[str] = set()
            for target in self.targets(expr):
                for node in _own_nodes(target.node):
                    if isinstance(node, ast.Return) and node.value is not None:
                        if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                            out |= self.item_keys(node.value, i, target, depth + 1)
            return out
        if isinstance(expr, ast.Name):
            args = fn.node.args
            if expr.id in [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]:
                out = set()
                for given, caller in self.arguments(fn, expr.id):
                    out |= self.item_keys(given, i, caller, depth + 1)
                return out
            out, found = set(), False
            for node in _own_nodes(fn.node):
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == expr.id for t in node.targets
                ):
                    out |= self.item_keys(node.value, i, fn, depth + 1)
                    found = True
            if found:
                return out
        raise Unresolved(f"item {i} of {ast.unparse(expr)} in {fn.where}")

    def targets(self, call: ast.Call) -> list[Function]:
        """The function a call runs: one of that name that returns something (a method's name
        shared by two such is no guess: Unresolved)."""
        found = [f for f in self.by_name.get(_call_name(call) or "", []) if _returns(f)]
        if not found or (len(found) > 1 and isinstance(call.func, ast.Attribute)):
            raise Unresolved(ast.unparse(call))
        return found

    def arguments(self, fn: Function, name: str) -> list[tuple[ast.expr, Function]]:
        """What each caller of `fn` passes for its parameter `name`."""
        args = fn.node.args
        positional = [a.arg for a in [*args.posonlyargs, *args.args]]
        if positional and positional[0] in ("self", "cls"):
            positional = positional[1:]
        callers = self.calls.get(fn.node.name, [])
        if not callers:
            raise Unresolved(f"{name} in {fn.where}: no caller")
        out = []
        for call, caller in callers:
            if caller.where in self.hand.elsewhere:
                continue
            out += [(kw.value, caller) for kw in call.keywords if kw.arg == name]
            if name in positional and positional.index(name) < len(call.args):
                out.append((call.args[positional.index(name)], caller))
        return out

    def kwarg_keys(self, fn: Function, depth) -> set[str]:
        """A function's `**extra`: the keywords its callers give beyond its parameters."""
        args = fn.node.args
        named = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        out: set[str] = set()
        for call, caller in self.calls.get(fn.node.name, []):
            out |= self.call_kwargs(call, caller, {}, named, depth)
        return out

    def call_kwargs(self, call: ast.Call, caller: Function, bound, named, depth) -> set[str]:
        out: set[str] = set()
        for kw in call.keywords:
            if kw.arg is None:
                out |= self.keys(kw.value, caller, bound, depth + 1)
            elif kw.arg not in named:
                out.add(kw.arg)
        return out

    def param_keys(self, fn: Function, name: str, depth) -> set[str]:
        """A parameter's keys: what each caller passes for it."""
        out: set[str] = set()
        for given, caller in self.arguments(fn, name):
            out |= self.keys(given, caller, {}, depth + 1)
        return out

    def call_keys(self, call: ast.Call, fn: Function, bound, depth) -> set[str]:
        name = _call_name(call)
        if name == "dict":
            out = self.call_kwargs(call, fn, bound, set(), depth)
            for a in call.args:
                out |= self.keys(a, fn, bound, depth + 1)
            return out
        out = set()
        for target in self.targets(call):
            args = target.node.args
            named = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
            inner: dict[str, set[str]] = {}
            if args.kwarg is not None:
                inner[args.kwarg.arg] = self.call_kwargs(call, fn, bound, named, depth)
            for node in _own_nodes(target.node):
                if isinstance(node, ast.Return) and node.value is not None:
                    out |= self.keys(node.value, target, inner, depth + 1)
        return out

    # --- the emit sites ---------------------------------------------------------------------
    def add(self, event: str, fields: set[str]) -> None:
        self.emitted.setdefault(event, set()).update(fields)

    def run(self) -> Scan:
        for fn in self.functions:
            if fn.path in self.also_defined or fn.where in self.hand.elsewhere:
                continue
            for node in _own_nodes(fn.node):
                if isinstance(node, ast.Call):
                    self.site(node, fn)
        for event, ref, _why in self.hand.built:
            try:
                self.add(event, self.ref_keys(ref, 0))
            except Unresolved as exc:
                self.unresolved.append(f"{event} ({ref.where}): {exc}")
        return self

    def site(self, call: ast.Call, fn: Function) -> None:
        name = _call_name(call)
        if name not in ("emit", "EventToEmit") or not call.args:
            return
        first = call.args[0]
        where = f"{fn.where}:{call.lineno}"
        named = self.hand.named.get((fn.where, ast.unparse(first)))
        texts = _texts(first, fn)
        if texts:
            events: dict[str, tuple[str, ...]] = dict.fromkeys(texts, ())
        elif named is not None:
            events = named[0]
        elif _passes_on(first, fn):
            return
        else:
            self.unresolved.append(f"{where}: emits {ast.unparse(first)}, which is no name")
            return
        fields = {kw.arg for kw in call.keywords if kw.arg}
        spreads = [kw.value for kw in call.keywords if kw.arg is None]
        if name == "EventToEmit":
            spreads += call.args[1:]
        for expr in spreads if not any(events.values()) else []:
            try:
                fields |= self.keys(expr, fn, {})
            except Unresolved as exc:
                self.unresolved.append(f"{where}: {exc}")
        for event, own in events.items():
            self.add(event, fields | set(own))

    def ref_keys(self, ref: Ref, depth) -> set[str]:
        fn = next((f for f in self.functions if f.where == ref.where), None)
        if fn is None:
            raise Unresolved(f"no function {ref.where}")
        if ref.name is not None:
            return self.name_keys(ref.name, fn, {}, depth + 1)
        found: list[ast.expr] = []
        for node in _own_nodes(fn.node):
            if ref.keyword is not None:
                if isinstance(node, ast.keyword) and node.arg == ref.keyword:
                    found.append(node.value)
            elif ref.call is not None:
                if isinstance(node, ast.Call) and _call_name(node) == ref.call:
                    found.append(node.args[0])
            elif isinstance(node, ast.Return) and node.value is not None:
                found.append(node.value)
        if not found:
            raise Unresolved(f"nothing in {ref}")
        return set().union(*(self.keys(e, fn, {}, depth + 1) for e in found))


def _returns(fn: Function) -> bool:
    return any(isinstance(n, ast.Return) and n.value for n in _own_nodes(fn.node))


def _texts(expr: ast.expr, fn: Function) -> set[str]:
    """The event names an emit's first argument can be: a string, a choice of strings, or a
    local name last set to those before it (`said = "a" if x else "b"`); else none."""
    if _is_text(expr):
        return _constants(expr, "")
    if not isinstance(expr, ast.Name):
        return set()
    before = [
        n
        for n in _own_nodes(fn.node)
        if isinstance(n, ast.Assign)
        and n.lineno < expr.lineno
        and any(isinstance(t, ast.Name) and t.id == expr.id for t in n.targets)
    ]
    last = max(before, key=lambda n: n.lineno, default=None)
    return _constants(last.value, "") if last and _is_text(last.value) else set()


def _passes_on(first: ast.expr, fn: Function) -> bool:
    """`emit(event, **facts)` inside `def emit(self, event, **facts)`: a wrapper, whose callers
    are sites of their own; or an EventToEmit handed on (`note.event`)."""
    args = fn.node.args
    params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    if isinstance(first, ast.Name) and first.id in params:
        return True
    return isinstance(first, ast.Attribute) and first.attr == "event"
