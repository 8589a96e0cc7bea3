"""Supervisor -> ranks: control messages (fault injection, standby go / exit), signed like the
heartbeat's and addressed to one rank of one attempt.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from contracts.intervals import TIERS
from contracts.messages import MAC_LEN, MAX_MESSAGE_BYTES, NUMBER, VERSION, BadMessage, _exact, sign

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
CONTROL_ACTIONS = frozenset(
    {"signal", "stall", "slow", "nan", "spike", "go", "exit", "become", "interval"}
)
STANDBY_ACTIONS = frozenset({"go", "exit", "become"})
CONTROL_FIELDS: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "job": str,
    "attempt": int,
    "rank": int,
    "t": NUMBER,
    "kind": str,
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
}
MAX_ENV_VARS = 256  # a `become`'s variables: the contract's and [launch] env's, with room
_CONTROL_EXACT = tuple((name, _exact(kind)) for name, kind in CONTROL_FIELDS.items())


def control_identity(attempt: int, rank: int) -> bytes:
    """The routing id of a rank's control socket: unique per attempt, so a straggler of an
    earlier attempt is never sent another attempt's command."""
    return f"{attempt}/{rank}".encode()


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
    }


def decode_control(key: bytes, frame: bytes, job: str, attempt: int, rank: int) -> dict[str, Any]:
    """Check a control frame (signed like the heartbeat's) is for this very rank; else raise."""
    if not MAC_LEN < len(frame) <= MAC_LEN + MAX_MESSAGE_BYTES:
        raise BadMessage(f"a control frame of {len(frame)} bytes", "frames")
    mac, body = frame[:MAC_LEN], frame[MAC_LEN:]
    if not hmac.compare_digest(sign(key, body), mac):
        raise BadMessage("bad signature", "signature")
    try:
        message = json.loads(body.decode())
    except ValueError as exc:
        raise BadMessage(f"not JSON: {exc}", "json") from None
    if not isinstance(message, dict):
        raise BadMessage("not a JSON object", "json")
    try:
        for name, exact in _CONTROL_EXACT:
            if message[name].__class__ not in exact:
                raise BadMessage(f"field {name!r} of the wrong type")
    except KeyError as exc:
        raise BadMessage(f"field {exc} missing") from None
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
