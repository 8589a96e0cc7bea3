"""A node's fork template (worker.template) and the processes the launcher starts in its place
(worker.template_client): where the template listens and what the two say to each other.

The launcher starts a small client for each rank; the client hands the template its command,
environment, working directory and open file descriptors (SCM_RIGHTS) and the template forks a
rank from its already-imported interpreter. The template answers with the rank's pid, and later
with how it ended; the client mirrors that end as its own, so the launcher sees the rank's exit
code or signal. Every message is one JSON object behind a 4-byte big-endian length: nothing read
from the socket is unpickled, and the template serves only its own user (SO_PEERCRED) and only
the job's key.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
from collections.abc import Mapping
from typing import Any

from contracts import env_names

MAX_REQUEST_BYTES = 1 << 20  # a command and an environment: far below this
MAX_FDS = 64  # descriptors one client hands over (stdio, the PMI socket, a few more)
_LENGTH = struct.Struct(">I")
# A rank's stop signals (worker.train's StopRequest). A forked rank, and a client that starts its
# rank cold, keep them blocked until the rank has its handlers: one that came early (a stop while
# the template imports) waits for them instead of ending the rank or being lost.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The line a template prints once its imports are done and it serves: until the supervisor reads
# it, the template's start is taking its node's cores (its ranks' straggler scores wait).
READY_LINE = "template: ready"
# Names that the C library, the dynamic loader and the interpreter read once, as a process starts:
# a forked rank runs with its template's, whatever its own environment says, so a template forks
# only for a client that has the same values as it has (the ranks' malloc tunable was lost so
# once, and every forked rank's step ran a quarter slower than a cold one's). Not every name read
# at the start (LD_LIBRARY_PATH, OMP_* are not here): what sets malloc, a preload or the hash.
START_NAMES = ("GLIBC_TUNABLES", "LD_PRELOAD", "PYTHONHASHSEED", "PYTHONMALLOC")
START_PREFIXES = ("MALLOC_",)


def start_env(env: Mapping[str, str]) -> dict[str, str]:
    """Pure: the names of `env` that a process reads only as it starts."""
    return {k: v for k, v in env.items() if k in START_NAMES or k.startswith(START_PREFIXES)}


def start_env_differs(own: Mapping[str, str], wanted: Mapping[str, str]) -> str | None:
    """Pure: why a rank that wants `wanted` as its environment cannot be forked from a template
    that started with `own` (a name read at the start set otherwise), or None."""
    mine, theirs = start_env(own), start_env(wanted)
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            return (f"{name} is {theirs.get(name)!r} for the rank, {mine.get(name)!r} for the "
                    "template (read as a process starts: a forked rank would run with the "
                    "template's)")  # fmt: skip
    return None


class TemplateError(Exception):
    """A message that breaks the contract (too long, not JSON, a field missing)."""


def socket_name(env: Mapping[str, str], hostname: str) -> str:
    """The template's abstract socket on this node: one per user, job and node name (emulated
    nodes share a host and its network namespace, so the node's name is part of it)."""
    job = env.get(env_names.ENV_JOB_ID, "")
    node = env_names.node_name(dict(env), hostname)
    return f"\0es-template-{os.getuid()}-{job}-{node}"


def peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and user of the process at the other end of a connected Unix socket (for a
    client: the template that listens), from SO_PEERCRED."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_REQUEST_BYTES:
        raise TemplateError(f"a message of {len(body)} bytes")
    return _LENGTH.pack(len(body)) + body


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    data = frame(message)
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _ints(fds))])
    else:
        sock.sendall(data)


def receive(sock: socket.socket, with_fds: bool = False) -> tuple[dict[str, Any] | None, list[int]]:
    """One message (None at a clean end of the stream) and the descriptors that came with it."""
    fds: list[int] = []
    head = b""
    while len(head) < _LENGTH.size:
        if with_fds and not head:
            chunk, fds = _recv_fds(sock, _LENGTH.size)
        else:
            chunk = sock.recv(_LENGTH.size - len(head))
        if not chunk:
            if head:
                raise TemplateError("the stream ended inside a message")
            return None, fds
        head += chunk
    length = _length(head)
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            raise TemplateError("the stream ended inside a message")
        body += chunk
    return _decode(body), fds


class Assembler:
    """One message read from a non-blocking socket in whatever pieces arrive: the template reads
    its requests so, and a client that sends slowly or never holds up no other."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.fds: list[int] = []

    def read(self, sock: socket.socket) -> dict[str, Any] | None:
        """The message once whole, None until then (BlockingIOError: nothing to read now); the
        descriptors that came with it are in `fds`. TemplateError: a broken message."""
        chunk, fds = _recv_fds(sock, 1 << 16)
        self.fds += fds
        if not chunk:
            raise TemplateError("the stream ended inside a message")
        self.data += chunk
        if len(self.data) < _LENGTH.size:
            return None
        length = _length(bytes(self.data[: _LENGTH.size]))
        if len(self.data) < _LENGTH.size + length:
            return None
        if len(self.data) > _LENGTH.size + length:
            raise TemplateError("more than one message")
        return _decode(self.data[_LENGTH.size :])


def _length(head: bytes) -> int:
    (length,) = _LENGTH.unpack(head)
    if length > MAX_REQUEST_BYTES:
        raise TemplateError(f"a message of {length} bytes")
    return length


def _decode(body: bytes | bytearray) -> dict[str, Any]:
    try:
        message = json.loads(body.decode())
    except (ValueError, RecursionError) as exc:
        raise TemplateError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise TemplateError("not a JSON object")
    return message


def _ints(fds) -> bytes:
    return struct.pack(f"{len(fds)}i", *fds)


def _recv_fds(sock: socket.socket, size: int) -> tuple[bytes, list[int]]:
    data, ancillary, _, _ = sock.recvmsg(size, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds += list(struct.unpack(f"{usable // 4}i", payload[:usable]))
    return data, fds
