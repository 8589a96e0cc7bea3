"""docs/architecture.md's event table against what the code emits, field by field, both ways: no
field on the page that the code never writes, no field the code writes that the page leaves out.

The code's side is tests/event_scan.py's reading of every emit with `ast` (nothing runs). What
it cannot follow is named here by hand (NAMED_BY_HAND, KEYS_BY_HAND, BUILT_ELSEWHERE), each with
where it comes from; a new emit it cannot follow fails the first test until it is.

The page's side: a row's last cell says when the event comes, then after a colon its fields: each
backticked name outside parentheses (a parenthesis explains the field before it); `as `launch``
or `the same fields as `hang`` takes that event's fields too. A row without a colon is fields
only.
"""

from __future__ import annotations

import re

import pytest

from supervisor.watch.table_events import GUARD_EVENTS
from tests.event_scan import Hand, Ref, Scan
from tests.support import REPO

SOURCES = [*(REPO / "supervisor").rglob("*.py"), *(REPO / "faults").rglob("*.py")]
# Where a function the supervisor calls is defined outside it (a worker spec's shrink plan).
ALSO_DEFINED = [REPO / "worker" / "shrink_plan.py"]
# Every event has them (architecture.md says so above the table), or every event of an attempt.
COMMON = {"event", "ts", "mono", "level", "attempt"}


# What the scan cannot follow by itself, each with where it comes from.
# (function, its emit's first argument) -> ({event: its fields (none: the spreads followed)}, why)
NAMED_BY_HAND: dict[tuple[str, str], tuple[dict[str, tuple[str, ...]], str]] = {
    ("supervisor/run/attempt.py:_found", "finding.kind"): (
        {"hang": (), "no_progress": ()}, "a hang or no progress (a rank_exit is said at once)"),
    ("supervisor/run/rank_watch.py:until_finding", "finding.kind"): (
        {"rank_exit": ()}, "only a rank_exit is emitted there"),
    ("supervisor/watch/table_events.py:guard_event", "msg['kind']"): (
        {event: tuple(names.values()) for event, names in GUARD_EVENTS.items()},
        "a guard message's kind; its fields are GUARD_EVENTS' values"),
}  # fmt: skip
# (function, an expression it spreads or names) -> (where its keys come from, why)
KEYS_BY_HAND: dict[tuple[str, str], tuple[Ref, str]] = {
    ("supervisor/run/attempt.py:_found", "got.facts"): (
        Ref("supervisor/run/finding_stacks.py:collect", call="FindingStacks"),
        "the stacks' facts a finding's event carries"),
    ("supervisor/run/job.py:_open", "self.continued"): (
        Ref("supervisor/commands/continuing.py:event"), "Continuation.event(), from `run`"),
    ("faults/inflight.py:events", "p.fields"): (
        Ref("faults/engine.py:_fire", "fields"), "a deferred firing's fields, held until it acts"),
    ("supervisor/run/job.py:_attempts_from", "decision.facts"): (
        Ref("supervisor/policy/restarts.py:decide", keyword="facts"), "a decision's facts"),
    ("supervisor/run/node_keeper.py:_shrink", "plan.event()"): (
        Ref("worker/shrink_plan.py:event"), "the worker spec's shrink plan (by name, no import)"),
}  # fmt: skip
# Events built in one function and emitted by another that hands them on under a name the scan
# cannot follow (EMITTED_ELSEWHERE: its emits are not read).
BUILT_ELSEWHERE: list[tuple[str, Ref, str]] = [
    ("fault", Ref("faults/inflight.py:events", "fault"), "a nan's or spike's, once it acted"),
    ("fault_undelivered", Ref("faults/inflight.py:events", "undelivered"), "a firing's misses"),
    ("events_reopened", Ref("supervisor/log/events.py:_reopen", "note"), "the log's own line"),
]
EMITTED_ELSEWHERE = {"faults/engine.py:_resolved"}  # emits what faults/inflight.py built
# Fields the scan finds in a shared helper that one of its events never carries.
NEVER_CARRIES = {
    ("rank_exit", "node"): "a finding is laid on a node only for a hang whose relay went silent "
    "(supervisor/watch/relays.py silent_relay); finding_fields writes it when there is one",
}


# --- the page ---------------------------------------------------------------------------------
_ROW = re.compile(r"^\| `([a-z_]+)` \| [^|]+ \| (.*) \|$")
_SAME = re.compile(r"^\s*(?:the same fields )?as `([a-z_]+)`")


def _outside_parentheses(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def documented() -> dict[str, set[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    start = text.index("\n## Events\n")
    rows = {}
    for line in text[start : text.index("\n## ", start + 1)].splitlines():
        m = _ROW.match(line)
        if m:
            rows[m.group(1)] = m.group(2)
    out: dict[str, set[str]] = {}
    fields = {event: _fields_part(cell) for event, cell in rows.items()}
    for event, part in fields.items():
        out[event] = set(re.findall(r"`([a-z][a-z0-9_]*)`", part))
    for event, part in fields.items():  # `as `launch``: that event's fields too
        same = _SAME.match(part)
        if same and same.group(1) in rows:
            out[event] = (out[event] - {same.group(1)}) | out[same.group(1)]
    return out


def _fields_part(cell: str) -> str:
    """Where a row names its fields: after what the event means (up to the first colon outside
    parentheses), outside the parentheses that explain a field."""
    plain = _outside_parentheses(cell)
    return plain.split(": ", 1)[1] if ": " in plain else plain


HAND = Hand(NAMED_BY_HAND, KEYS_BY_HAND, BUILT_ELSEWHERE, EMITTED_ELSEWHERE)


@pytest.fixture(scope="module")
def scan() -> Scan:
    return Scan(SOURCES, ALSO_DEFINED, HAND).run()


def test_the_scan_follows_every_emit(scan):
    said = "\n".join(scan.unresolved)
    assert not said, f"the scan cannot follow these; say where they come from by hand:\n{said}"
    assert {"start", "attempt_end", "fault", "hang", "numeric_fault"} <= set(scan.emitted)
    assert {"returncode", "said_done", "stopped"} <= scan.emitted["exit"]  # **extra followed


def emitted(scan: Scan) -> dict[str, set[str]]:
    out = {event: set(fields) for event, fields in scan.emitted.items()}
    for event, name in NEVER_CARRIES:
        out[event].discard(name)
    return out


def test_every_emitted_field_is_on_the_page(scan):
    page = documented()
    missing = {
        event: sorted(fields - COMMON - page.get(event, set()))
        for event, fields in sorted(emitted(scan).items())
        if fields - COMMON - page.get(event, set())
    }
    assert not missing, f"fields the code writes that docs/architecture.md lacks: {missing}"


def test_every_field_on_the_page_is_emitted(scan):
    code = emitted(scan)
    extra = {
        event: sorted(fields - code.get(event, set()) - COMMON)
        for event, fields in sorted(documented().items())
        if fields - code.get(event, set()) - COMMON
    }
    assert not extra, f"fields on docs/architecture.md that the code never writes: {extra}"
