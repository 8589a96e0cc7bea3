"""Heartbeats from a rank to the supervisor (DESIGN.md: ranks -> supervisor).

STUB: the interface the training loop calls. Without ES_HEARTBEAT_ADDR every call is a no-op.
The ZeroMQ implementation (background thread, bounded queue, HMAC-signed JSON) replaces this.
"""

from __future__ import annotations


class Beacon:
    """What the training loop tells the supervisor. Every method returns at once."""

    @classmethod
    def from_env(cls, rank: int, world: int) -> Beacon:
        return cls()

    def hello(self, phase: str) -> None: ...

    def phase(self, phase: str, step: int) -> None: ...

    def step(self, step: int, loss: float, dt: float) -> None: ...

    def ckpt(self, step: int, state: str) -> None: ...

    def resumed(self, step: int, restart_seconds: float) -> None: ...

    def error(self, message: str) -> None: ...

    def done(self, step: int) -> None: ...

    def close(self) -> None: ...
