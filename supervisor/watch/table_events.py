"""What the rank table and the limit learner hand the attempt: one event each to write to the
event log (the attempt writes it and acts on a few of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EventToEmit:
    """Something an attempt's messages revealed that is worth one event: its name and fields."""

    event: str
    fields: dict[str, Any]


# The numerical guard's messages (rank 0's, one per bad step / rollback for the job): message
# field -> event field. A message's `fault` is the event's `kind` (a message's own `kind` is its
# type).
GUARD_EVENTS: dict[str, dict[str, str]] = {
    "numeric_fault": {
        "step": "step", "ranks": "ranks", "fault": "kind", "value": "value", "what": "what",
        "action": "action",
    },
    "rollback": {"from_step": "from_step", "to_step": "to_step", "skip": "skip"},
}  # fmt: skip


def guard_event(msg: dict[str, Any]) -> EventToEmit:
    """The `numeric_fault` or `rollback` event of a verified guard message."""
    names = GUARD_EVENTS[msg["kind"]]
    return EventToEmit(msg["kind"], {out: msg[key] for key, out in names.items()})
