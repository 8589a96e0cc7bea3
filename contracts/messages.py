"""Ranks -> supervisor: the heartbeat message schema, its signing and the relay summary's
run-length coding. Nothing received is unpickled: frames are HMAC-signed JSON.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from contracts.intervals import TIERS

# --- ranks -> supervisor: messages --------------------------------------------------------------
VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024

PHASES = ("init", "standby", "load", "train", "save", "done")
# `memory`: this rank's copy of that step into the memory tier is sealed (every rank says it;
# at most one a heartbeat interval each: worker.beat). The others are rank 0's durable saves.
CKPT_STATES = frozenset({"staged", "written", "complete", "memory"})
# Where a `resumed` rank's state came from (its optional `source`; absent without a memory tier).
RESUME_SOURCES = frozenset({"memory", "partner", "durable"})
MAX_WHY = 2000

COMMON_FIELDS: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "job": str,
    "attempt": int,
    "rank": int,
    "world": int,
    "host": str,
    "pid": int,
    "t": (int, float),
    "kind": str,
}
NUMBER = (int, float)
KIND_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"phase": str},
    "beat": {"phase": str, "step": int},
    "step": {"step": int, "loss": NUMBER, "dt": NUMBER},
    # + `prepared` (str) and `cpu_s` (the process's CPU seconds so far) when the phase is standby
    "phase": {"phase": str, "step": int},
    "ckpt": {"step": int, "state": str},
    # + `source` (str): RESUME_SOURCES; + `why` (str, at most MAX_WHY): what the memory tier
    # passed over and why (a slot a rank refused, naming the rank)
    "resumed": {"step": int, "restart_seconds": NUMBER},
    "error": {"message": str},  # + `cause` (str): ERROR_CAUSES, when the rank knows it
    "done": {"step": int},
    # A node's relay (sent as the relay's own rank), run-length coded (a node's ranks are mostly
    # consecutive and step together): `node` (its name), `ranks` ([first, count] runs, ascending:
    # every rank of the node heard from, the relay's own included), `steps` ([step, count] runs
    # in that rank order: each one's latest step), `phases` (one str when they all share it, else
    # [phase, count] runs), `late` ([rank, age_s] for each rank not heard from since the relay's
    # previous summary: its last message is `age_s` old; every other one was heard from since).
    "summary": {"node": str, "ranks": list, "steps": list, "phases": (str, list), "late": list},
    # The numerical guard (rank 0, once for the job): step `step` was not applied; `fault`:
    # NUMERIC_FAULTS; `value` the value judged (a str for a non-finite one: "nan", "inf");
    # `what`: "loss" or "grad_norm"; `ranks`: the ranks behind it; `action`: the guard's.
    "numeric_fault": {
        "step": int, "ranks": list, "fault": str, "value": (int, float, str), "what": str,
        "action": str,
    },
    # ... and rolled back from the bad step to a checkpoint's, skipping data positions "A-B".
    "rollback": {"from_step": int, "to_step": int, "skip": str},
    # The target rank of a `nan` or `spike` command (contracts.control_msgs): what came of it.
    # `fault` and `step` as the command said; `applied`: acted on at `step`; else it came only
    # once the rank was at step `at`, past it (`at` == `step` when applied).
    "fault_ack": {"fault": int, "step": int, "action": str, "applied": bool, "at": int},
}  # fmt: skip
NUMERIC_FAULTS = frozenset({"nan", "inf", "spike"})
# An `error`'s optional `cause`: "diverged", the numerical guard gave up (the worker's exit 3);
# "usage", the rank refused its flags or inputs (exit 2). Either way the supervisor ends the job
# at once: a relaunch would fail the same way.
ERROR_CAUSES = frozenset({"diverged", "usage"})
ACKED_ACTIONS = frozenset({"nan", "spike"})  # the control actions a rank says the fate of
# Stragglers (worker.step_clock): a `beat` and a `step` may carry the latest step's `compute` and
# `wait` (seconds in collectives); a `summary` may carry `compute`, one per rank in its rank
# order (null: not said yet). Optional: senders without them are accepted.
TIMING_FIELDS = ("compute", "wait")
MAX_TIMING_S = 1e6
# ... and `recent`: [step, compute] of each step since the rank's previous message, oldest first
# (at most MAX_RECENT: the newest), so the supervisor scores every step, not one a beat.
MAX_RECENT = 64
# Rank 0's `step` may carry `cost`: {tier: seconds} (contracts.intervals.TIERS), what the copies
# and saves since its previous step message cost the loop (the supervisor tunes "auto" intervals
# by them). Optional.
# The most ranks one summary may speak for (a node's ranks; 16 KiB hold ~1,000 of them).
MAX_RELAY_RANKS = 1024


class BadMessage(ValueError):
    """A message that is unsigned, wrongly signed, malformed, oversized or of another job.

    `reason` is a short category (frames, oversized, signature, json, schema, version,
    other_job) that the supervisor counts dropped messages by.
    """

    def __init__(self, detail: str, reason: str = "schema") -> None:
        super().__init__(detail)
        self.reason = reason


def sign(key: bytes, body: bytes) -> bytes:
    # Copying an already-keyed HMAC is about twice as fast as keying one per message (and
    # OpenSSL 3's digest lookup): the supervisor verifies every message of every rank.
    mac = _keyed(key).copy()
    mac.update(body)
    return mac.hexdigest().encode()


@functools.lru_cache(maxsize=8)
def _keyed(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


MAC_LEN = 64  # hex HMAC-SHA256


def encode(key: bytes, message: dict[str, Any]) -> bytes:
    """One ZeroMQ frame: the hex HMAC-SHA256 of the JSON body, then the body.

    One frame rather than two: receiving a multipart message costs the supervisor several
    times more than a single frame, per message of every rank.
    """
    body = json.dumps(message, separators=(",", ":"), allow_nan=True).encode()
    return sign(key, body) + body


def signed_json(key: bytes, frame: bytes) -> dict[str, Any]:
    """The JSON object of a frame (its MAC, then the body) signed with `key`; else raise
    BadMessage. The caller has checked its size. Nothing read from a socket is unpickled."""
    mac, body = frame[:MAC_LEN], frame[MAC_LEN:]
    if not hmac.compare_digest(sign(key, body), mac):
        raise BadMessage("bad signature", "signature")
    try:
        message = json.loads(body.decode())
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise BadMessage(f"not JSON: {exc}", "json") from None
    if not isinstance(message, dict):
        raise BadMessage("not a JSON object", "json")
    return message


def decode(key: bytes, frame: bytes, job: str | None = None) -> dict[str, Any]:
    """Check size, signature and schema; return the message or raise BadMessage."""
    if len(frame) <= MAC_LEN:
        raise BadMessage(f"a frame of {len(frame)} bytes holds no signed message", "frames")
    if len(frame) > MAC_LEN + MAX_MESSAGE_BYTES:
        raise BadMessage(f"oversized message ({len(frame) - MAC_LEN} bytes)", "oversized")
    message = signed_json(key, frame)
    validate(message)
    if job is not None and message["job"] != job:
        raise BadMessage(f"message of another job {message['job']!r}", "other_job")
    return message


def validate(message: dict[str, Any]) -> None:
    kind = message.get("kind")
    fields = _FIELDS_OF_KIND.get(kind) if kind.__class__ is str else None
    # One flat loop over exact types: the supervisor validates every beat of every rank. JSON
    # gives exact types, and a bool where a number belongs is malformed (bool is not in a set).
    try:
        for name, exact in fields or _COMMON_EXACT:
            if message[name].__class__ not in exact:
                raise BadMessage(f"field {name!r} of the wrong type")
    except KeyError as exc:
        raise BadMessage(f"field {exc} missing") from None
    if message["v"] != VERSION:
        raise BadMessage(f"unknown protocol version {message['v']}", "version")
    if fields is None:
        raise BadMessage(f"unknown kind {kind!r}")
    if kind == "ckpt" and message["state"] not in CKPT_STATES:
        raise BadMessage(f"unknown checkpoint state {message['state']!r}")
    if kind == "summary":
        validate_summary(message)
    if kind == "beat" or kind == "step":
        validate_timing(message)
    if kind == "phase" and "cpu_s" in message and not _seconds(message["cpu_s"]):
        raise BadMessage("field 'cpu_s': expected seconds >= 0")
    if kind == "step" and "cost" in message:
        validate_cost(message["cost"])
    if kind == "numeric_fault":
        validate_numeric_fault(message)
    if kind == "fault_ack" and message["action"] not in ACKED_ACTIONS:
        raise BadMessage(f"a fault_ack of action {message['action']!r}")
    if kind == "error" and "cause" in message:
        cause = message["cause"]
        if cause.__class__ is not str or cause not in ERROR_CAUSES:
            raise BadMessage(f"field 'cause': expected one of {sorted(ERROR_CAUSES)}")
    if kind == "resumed" and "source" in message:
        source = message["source"]
        if source.__class__ is not str:
            raise BadMessage("field 'source' of the wrong type")
        if source not in RESUME_SOURCES:
            raise BadMessage(f"unknown resume source {source!r}")
    if kind == "resumed" and "why" in message:
        why = message["why"]
        if why.__class__ is not str or len(why) > MAX_WHY:
            raise BadMessage("field 'why' of the wrong type or too long")


_INT = frozenset({int})
_NUMBERS = frozenset({int, float})


def runs(values: list[Any]) -> list[list[Any]]:
    """[value, count] runs of `values` (a relay's summary codes its ranks' steps and phases so)."""
    out: list[list[Any]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def expand(coded: list[list[Any]]) -> list[Any]:
    out: list[Any] = []
    for value, count in coded:
        out += [value] * count
    return out


def rank_runs(ranks: list[int]) -> list[list[int]]:
    """Ascending ranks as [first, count] runs of consecutive ranks."""
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][0] + out[-1][1] == r:
            out[-1][1] += 1
        else:
            out.append([r, 1])
    return out


def expand_ranks(coded: list[list[int]]) -> list[int]:
    out: list[int] = []
    for first, count in coded:
        out += range(first, first + count)
    return out


def _coded(coded: Any, kinds: frozenset[type], what: str) -> int:
    """The number of values [value, count] runs code for; BadMessage when malformed."""
    n = 0
    for run in coded:
        if (
            run.__class__ is not list
            or len(run) != 2
            or run[0].__class__ not in kinds
            or run[1].__class__ is not int
            or run[1] < 1
        ):
            raise BadMessage(f"summary {what}: expected [value, count] runs")
        n += run[1]
    return n


def validate_summary(message: dict[str, Any]) -> None:
    """A relay's summary: well-formed runs coding the same number of ranks, ranks ascending
    (so each once), late ranks among them with ages >= 0."""
    ranks, steps, phases, late = (message[k] for k in ("ranks", "steps", "phases", "late"))
    n = _coded(ranks, _INT, "ranks")
    if not 0 < n <= MAX_RELAY_RANKS:
        raise BadMessage(f"a summary of {n} ranks (expected 1..{MAX_RELAY_RANKS})")
    end = -1
    for first, count in ranks:
        if first <= end:
            raise BadMessage("summary ranks: expected ascending runs of distinct ranks")
        end = first + count - 1
    if _coded(steps, _INT, "steps") != n:
        raise BadMessage("summary steps: expected one per rank")
    if phases.__class__ is list and _coded(phases, frozenset({str}), "phases") != n:
        raise BadMessage("summary phases: expected one per rank")
    for entry in late:
        if (
            entry.__class__ is not list
            or len(entry) != 2
            or entry[0].__class__ is not int
            or entry[1].__class__ not in _NUMBERS
            or not 0 <= entry[1] < 1e9
            or not any(first <= entry[0] < first + count for first, count in ranks)
        ):
            raise BadMessage("summary late: expected [rank, age_s] of its own ranks")
    if "compute" in message:
        _summary_compute(message, n)


def _seconds(value: Any) -> bool:
    return value.__class__ in _NUMBERS and 0 <= value < MAX_TIMING_S


def validate_timing(message: dict[str, Any]) -> None:
    """A beat's or step's optional `compute` and `wait`: seconds, finite and >= 0."""
    for name in TIMING_FIELDS:
        if name in message and not _seconds(message[name]):
            raise BadMessage(f"field {name!r}: expected seconds >= 0")
    if "recent" in message:
        _recent(message["recent"])


def validate_cost(cost: Any) -> None:
    """A step's `cost`: seconds >= 0 by checkpoint tier."""
    if cost.__class__ is not dict or not all(
        tier in TIERS and _seconds(seconds) for tier, seconds in cost.items()
    ):
        raise BadMessage(f"field 'cost': expected seconds >= 0 by tier ({', '.join(TIERS)})")


def _recent(recent: Any) -> None:
    """`recent`: at most MAX_RECENT [step, compute] pairs, steps ascending."""
    if recent.__class__ is not list or len(recent) > MAX_RECENT:
        raise BadMessage(f"field 'recent': expected at most {MAX_RECENT} [step, compute] pairs")
    last = -1
    for pair in recent:
        if (
            pair.__class__ is not list
            or len(pair) != 2
            or pair[0].__class__ is not int
            or pair[0] <= last
            or not _seconds(pair[1])
        ):
            raise BadMessage("field 'recent': expected [step, seconds >= 0] pairs, steps ascending")
        last = pair[0]


def _summary_compute(message: dict[str, Any], n: int) -> None:
    compute = message["compute"]
    if compute.__class__ is not list or len(compute) != n:
        raise BadMessage("summary compute: expected one per rank")
    for value in compute:
        if value is not None and not _seconds(value):
            raise BadMessage("summary compute: expected seconds >= 0 or null")


def validate_numeric_fault(message: dict[str, Any]) -> None:
    ranks = message["ranks"]
    if message["fault"] not in NUMERIC_FAULTS:
        raise BadMessage(f"unknown numeric fault {message['fault']!r}")
    if len(ranks) > MAX_RELAY_RANKS or any(r.__class__ is not int for r in ranks):
        raise BadMessage("numeric_fault ranks: expected a list of ranks")


def _exact(kind: type | tuple[type, ...]) -> frozenset[type]:
    return frozenset(kind if isinstance(kind, tuple) else (kind,))


_COMMON_EXACT = tuple((name, _exact(kind)) for name, kind in COMMON_FIELDS.items())
_FIELDS_OF_KIND = {
    kind: _COMMON_EXACT + tuple((name, _exact(k)) for name, k in fields.items())
    for kind, fields in KIND_FIELDS.items()
}


@dataclass(frozen=True)
class RankIdentity:
    """Who sends: fixed for the life of a rank process."""

    job: str
    attempt: int
    rank: int
    world: int
    host: str
    pid: int

    def message(self, kind: str, t: float, **fields: Any) -> dict[str, Any]:
        return {
            "v": VERSION,
            "job": self.job,
            "attempt": self.attempt,
            "rank": self.rank,
            "world": self.world,
            "host": self.host,
            "pid": self.pid,
            "t": t,
            "kind": kind,
            **fields,
        }
