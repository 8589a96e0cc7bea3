"""Supervisor -> ranks: control messages (fault injection, standby go / exit), signed like the
heartbeat's and addressed to one rank of one attempt; and the channel's keys and the hello by
which a rank claims its identity on it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from contracts.intervals import TIERS
from contracts.messages import (
    MAC_LEN,
    MAX_MESSAGE_BYTES,
    NUMBER,
    VERSION,
    BadMessage,
    _exact,
    signed_json,
)

# --- supervisor -> ranks: control (fault injection, standby) -------------------------------------
# signal: the rank signals itself (`signal` = the number); stall: it blocks inside its next step
# while its beat thread keeps beating; slow: it sleeps `delay_s` per step for `duration_s`.
# nan / spike: a NaN in one of its gradients / its loss scaled by `factor`, at step `step` itself
# (the numerical guard's faults: worker.guard_step); sent ahead and held for that step. The rank
# says what came of each (a `fault_ack`: contracts.messages): applied, or not (it came after
# that step had begun).
# go / exit: a standby rank resumes and trains / ends (`fault` is 0 for both).
# become: a prepared rank (worker.prepared, no rank number yet) takes `env` (the rank's and the
# attempt's variables) and starts as that rank; exit ends it too. Every other action's `env` is {}.
# interval: an "auto" tier's (`tier`: contracts.intervals.TIERS) new interval, `interval` steps,
# from step `step` on (sent to rank 0, whose word every rank adopts in the step's agreement:
# worker.intervals). Every other action's `tier` is "" and `interval` 0.
# lease: the rank may go on writing until wall time `until` (renewal number `epoch`: the
# supervisor's count); a rank whose lease ran out stops (worker.lease). Every other action's
# `until` is 0.0 and `epoch` 0.
CONTROL_ACTIONS = frozenset(
    {"signal", "stall", "slow", "nan", "spike", "go", "exit", "become", "interval", "lease"}
)
STANDBY_ACTIONS = frozenset({"go", "exit", "become"})
# Every frame of the channel, either way: who it is for or from, when, and what it is.
ENVELOPE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "job": str,
    "attempt": int,
    "rank": int,
    "t": NUMBER,
    "kind": str,
}
CONTROL_FIELDS: dict[str, type | tuple[type, ...]] = {
    **ENVELOPE_FIELDS,
    "action": str,
    "fault": int,
    "signal": int,
    "delay_s": NUMBER,
    "duration_s": NUMBER,
    "step": int,
    "factor": NUMBER,
    "env": dict,
    "tier": str,
    "interval": int,
    "until": NUMBER,
    "epoch": int,
}
MAX_ENV_VARS = 256  # a `become`'s variables: the contract's and [launch] env's, with room
_CONTROL_EXACT = tuple((name, _exact(kind)) for name, kind in CONTROL_FIELDS.items())


def control_conn(attempt: int, rank: int, nonce: str) -> bytes:
    """The routing id of a rank's control socket: `<attempt>/<rank>/<nonce>`, the nonce random per
    process (16 hex digits), so that no two processes ever share one: which of them owns
    `<attempt>/<rank>` is the supervisor's call, on their hellos (supervisor.policy.control_claims).
    The attempt in it keeps a straggler of an earlier attempt from another attempt's commands."""
    return f"{attempt}/{rank}/{nonce}".encode()


def control_message(
    job: str,
    attempt: int,
    rank: int,
    t: float,
    action: str,
    fault: int,
    signal: int = 0,
    delay_s: float = 0.0,
    duration_s: float = 0.0,
    step: int = 0,
    factor: float = 1.0,
    env: dict[str, str] | None = None,
    tier: str = "",
    interval: int = 0,
    until: float = 0.0,
    epoch: int = 0,
) -> dict[str, Any]:
    return {
        "v": VERSION,
        "job": job,
        "attempt": attempt,
        "rank": rank,
        "t": t,
        "kind": "control",
        "action": action,
        "fault": fault,
        "signal": signal,
        "delay_s": float(delay_s),
        "duration_s": float(duration_s),
        "step": int(step),
        "factor": float(factor),
        "env": dict(env or {}),
        "tier": tier,
        "interval": int(interval),
        "until": float(until),
        "epoch": int(epoch),
    }


def decode_control(key: bytes, frame: bytes, job: str, attempt: int, rank: int) -> dict[str, Any]:
    """Check a control frame (signed like the heartbeat's) is for this very rank; else raise."""
    message = _signed_object(key, frame, MAX_MESSAGE_BYTES, _CONTROL_EXACT)
    if message["v"] != VERSION or message["kind"] != "control":
        raise BadMessage("not a control message of this version", "version")
    if message["action"] not in CONTROL_ACTIONS:
        raise BadMessage(f"unknown control action {message['action']!r}")
    env = message["env"]
    if len(env) > MAX_ENV_VARS or not all(
        k.__class__ is str and v.__class__ is str for k, v in env.items()
    ):
        raise BadMessage(
            f"field 'env': expected at most {MAX_ENV_VARS} names and values, all strings"
        )
    if message["action"] == "interval" and not (
        message["tier"] in TIERS and message["interval"] >= 1 and message["step"] >= 0
    ):
        raise BadMessage(f"field 'tier' or 'interval': expected one of {TIERS} and steps >= 1")
    if (message["job"], message["attempt"], message["rank"]) != (job, attempt, rank):
        raise BadMessage("a control message for another rank, attempt or job", "other_job")
    return message


def _signed_object(
    key: bytes, frame: bytes, limit: int, exact: tuple[tuple[str, frozenset[type]], ...]
) -> dict[str, Any]:
    """The JSON object a frame signed with `key` holds, each field of its exact type; else raise
    (nothing read from a socket is unpickled)."""
    if not MAC_LEN < len(frame) <= MAC_LEN + limit:
        raise BadMessage(f"a control frame of {len(frame)} bytes", "frames")
    message = signed_json(key, frame)
    try:
        for name, kinds in exact:
            if message[name].__class__ not in kinds:
                raise BadMessage(f"field {name!r} of the wrong type")
    except KeyError as exc:
        raise BadMessage(f"field {exc} missing") from None
    return message


# --- ranks -> supervisor: the claim of an identity ------------------------------------------------
# The channel runs over ZeroMQ CURVE: the supervisor's ROUTER is the server, each rank's DEALER a
# client, and both key pairs are derived from the job's key (ES_HEARTBEAT_KEY, which every rank is
# handed at launch): a peer without it cannot finish the handshake, so it never reaches the
# ROUTER's table, let alone claims an identity. Over that connection the rank's first and only
# frame is its hello: it claims `<attempt>/<rank>` for the routing id that carries it (`conn`).
CURVE_SERVER = b"es-control-curve-server-v1"
CURVE_CLIENT = b"es-control-curve-client-v1"
HELLO_KIND = "control_hello"
MAX_HELLO_BYTES = 512  # the supervisor's ROUTER takes no bigger frame from a rank (with its MAC)
HELLO_FIELDS: dict[str, type | tuple[type, ...]] = {**ENVELOPE_FIELDS, "conn": str}
_HELLO_EXACT = tuple((name, _exact(kind)) for name, kind in HELLO_FIELDS.items())


def curve_secret(key: bytes, side: bytes) -> bytes:
    """A CURVE secret key (32 bytes) of the channel: `side` CURVE_SERVER or CURVE_CLIENT. Derived
    from the job's key, so that nothing more is handed to the ranks and a process that holds the
    key is all a rank trusts; the public halves follow (zmq.curve_public)."""
    return hmac.new(key, side, hashlib.sha256).digest()


def control_hello(job: str, attempt: int, rank: int, t: float, conn: bytes) -> dict[str, Any]:
    return {
        "v": VERSION,
        "job": job,
        "attempt": attempt,
        "rank": rank,
        "t": t,
        "kind": HELLO_KIND,
        "conn": conn.decode(),
    }


def decode_hello(key: bytes, frame: bytes, job: str) -> dict[str, Any]:
    """A hello's signature, schema and job; else raise (which routing id may own the identity it
    claims is supervisor.policy.control_claims's)."""
    message = _signed_object(key, frame, MAX_HELLO_BYTES - MAC_LEN, _HELLO_EXACT)
    if message["v"] != VERSION or message["kind"] != HELLO_KIND:
        raise BadMessage("not a control hello of this version", "version")
    if message["attempt"] < 0 or message["rank"] < 0:
        raise BadMessage("field 'attempt' or 'rank': expected >= 0")
    if message["job"] != job:
        raise BadMessage(f"a hello of another job {message['job']!r}", "other_job")
    return message
