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
