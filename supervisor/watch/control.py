"""The supervisor's end of the control channel: signed commands to single ranks.

One ROUTER socket that each rank's beat thread connects a DEALER to (routing id `attempt/rank`,
`control_msgs.control_identity`). The faults use it for `signal`/`stall`/`slow`, the standby for
`go`/`exit`. Sends never block; a rank not connected yet is reported, not waited for.
"""

from __future__ import annotations

import errno
from typing import Any

import zmq

from contracts import control_msgs, messages


class ControlServer:
    """The supervisor's end of the control channel."""

    def __init__(self, key: bytes, job: str, bind: str, advertise: str) -> None:
        self.key, self.job = key, job
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Unknown routing id -> EHOSTUNREACH instead of a silent drop: we learn of it.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Ranks send nothing on it: cap what a stray peer could make us buffer.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1024)
        port = self._sock.bind_to_random_port(f"tcp://{bind}")
        self.address = f"tcp://{advertise}:{port}"

    def send(self, attempt: int, rank: int, message: dict[str, Any]) -> str | None:
        """Queue one command for a rank; None when sent, else why not."""
        frame = messages.encode(self.key, message)
        try:
            self._sock.send_multipart(
                [control_msgs.control_identity(attempt, rank), frame], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return "rank not connected to the control channel"
            return f"control send failed: {exc}"
        return None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def command(
        self, attempt: int, rank: int, action: str, t: float, env: dict[str, str] | None = None
    ) -> str | None:
        """A `go`, `exit` or `become` (with the rank's `env`) to one rank."""
        message = control_msgs.control_message(self.job, attempt, rank, t, action, 0, env=env)
        return self.send(attempt, rank, message)


def bind_for(heartbeat_address: str) -> tuple[str, str]:
    """(bind, advertise) of the control socket: where the heartbeat server is reached."""
    host = heartbeat_address.removeprefix("tcp://").rsplit(":", 1)[0]
    return ("127.0.0.1" if host in ("127.0.0.1", "localhost") else "0.0.0.0"), host
