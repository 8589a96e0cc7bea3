"""The contracts between the supervisor and the ranks, in one place.

Environment names (supervisor -> ranks), the heartbeat message schema with its signing
(ranks -> supervisor), and who owns a run or checkpoint directory (a lock file). This module
imports only the standard library: it is the one piece of `supervisor/` that `worker/` imports,
so neither side can drift from the other.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import hmac
import json
import os
import re
import signal
import tempfile
from dataclasses import dataclass
from typing import Any

# --- supervisor -> ranks: environment ---------------------------------------------------------
ENV_JOB_ID = "ES_JOB_ID"
ENV_ATTEMPT = "ES_ATTEMPT"
ENV_HEARTBEAT_ADDR = "ES_HEARTBEAT_ADDR"
ENV_HEARTBEAT_KEY = "ES_HEARTBEAT_KEY"
ENV_ATTEMPT_DIR = "ES_ATTEMPT_DIR"
# Optional: seconds between liveness beats (the supervisor passes its [heartbeat] interval_s).
ENV_HEARTBEAT_INTERVAL = "ES_HEARTBEAT_INTERVAL"
# Optional: "1" asks each rank to die with its parent (PR_SET_PDEATHSIG, and a parent-pid watch
# in the beat thread), so that a supervisor killed with SIGKILL leaves no rank behind.
ENV_EXIT_WITH_PARENT = "ES_EXIT_WITH_PARENT"
# Optional: "1" starts the ranks as a warm standby ([restart] standby): they prepare everything a
# resume does not need (imports, process group, model, optimizer, one warm-up forward and
# backward), say phase `standby`, and wait for a signed `go` (resume and train as attempt
# ES_ATTEMPT) or `exit` on the control channel, which is then always set.
ENV_STANDBY = "ES_STANDBY"
# Optional: where the memory checkpoint tier keeps its node-local directories (default /dev/shm).
ENV_MEM_ROOT = "ES_MEM_ROOT"
# Optional: "1" makes local rank 0 of each node (with more than one rank on it) its node's relay:
# the node's other ranks send to it over a node-local socket, and it forwards one signed `summary`
# of their beats and steps per interval instead of each rank's beats ([heartbeat] relay).
ENV_HEARTBEAT_RELAY = "ES_HEARTBEAT_RELAY"

# --- who owns a directory ------------------------------------------------------------------------
# One job per run dir and per checkpoint dir: its owner holds an flock on this file for its whole
# life (the kernel drops it when the owner dies, however it dies) and writes who it is into it.
LOCK_FILE = ".es-lock"


class DirInUse(Exception):
    """The directory's lock is held; `holder` is what its owner wrote (may be empty)."""

    def __init__(self, path: str, holder: dict[str, Any]) -> None:
        self.path, self.holder = path, holder
        who = ", ".join(f"{k} {holder[k]}" for k in ("job", "host", "pid") if k in holder)
        super().__init__(f"{path} is in use by another job ({who or 'owner unknown'})")


def lock_dir(path: str | os.PathLike, holder: dict[str, Any]) -> int:
    """Take `path`'s lock for as long as the returned descriptor stays open (not inherited by
    children), or raise DirInUse naming the owner."""
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirInUse(str(path), read_lock_holder(path)) from None
    body = json.dumps(holder).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, body, 0)
    return fd


def lock_holder(path: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds `path`'s lock now, or None when nobody does (or there is no lock file)."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_lock_holder(path)
    finally:
        os.close(fd)  # also drops the shared lock taken to test it
    return None


def read_lock_holder(path: str | os.PathLike) -> dict[str, Any]:
    """What the owner wrote (JSON, never unpickled); {} when unreadable."""
    try:
        with open(os.path.join(path, LOCK_FILE), "rb") as f:
            data = json.loads(f.read(4096) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --- the memory checkpoint tier's directory -------------------------------------------------------
# One directory per job on every node (`--mem-ckpt-interval`): `<root>/es-mem-<tag>/`, where the tag
# is the job id under the supervisor (`<job name>-<8 hex digits>`), else a hash of the checkpoint
# dir (12 hex digits). It outlives the ranks; whoever uses it (the supervisor for the job's life,
# each rank for its own) holds a shared flock on its LOCK_FILE, so a directory whose lock can be
# taken exclusively belongs to no live job and may be removed (if of exactly this form: a sweep
# touches nothing else, `MEM_DIR_NAME`).
MEM_ROOT_DEFAULT = "/dev/shm"
MEM_PREFIX = "es-mem-"
# A job name (config.name_problem checks it against these): ASCII letters, digits, ".", "_",
# "-", starting with a letter or digit, at most JOB_NAME_MAX, no "..".
JOB_NAME_MAX = 64
_NAME_FIRST, _NAME_REST = "[A-Za-z0-9]", "[A-Za-z0-9._-]"
JOB_NAME = re.compile(f"{_NAME_FIRST}{_NAME_REST}*", re.ASCII)
# The tag of a job's scratch: a job name, then the job id's 8 hex digits; or a worker's own
# 12-digit hash.
_MEM_TAG = re.compile(
    rf"(?:(?!.*\.\.){_NAME_FIRST}{_NAME_REST}{{0,{JOB_NAME_MAX - 1}}}-[0-9a-f]{{8}}"
    r"|[0-9a-f]{12})",
    re.ASCII,
)
MEM_DIR_NAME = re.compile(re.escape(MEM_PREFIX) + _MEM_TAG.pattern, re.ASCII)


# The launcher's own name for a rank's node (Hydra's emulated nodes run on one host under
# several names), else the host name: what relays and the pre-launch node check go by.
NODE_NAME_VARS = ("PMI_HOSTNAME", "SLURMD_NODENAME")


def node_name(env: dict[str, str] | os._Environ, hostname: str) -> str:
    return next((env[v] for v in NODE_NAME_VARS if env.get(v)), hostname)


def mem_root(env: dict[str, str] | os._Environ) -> str:
    """`ES_MEM_ROOT`, else /dev/shm, else (a system without it) the temp dir: the page cache
    then holds the slots, and the tier still works."""
    if env.get(ENV_MEM_ROOT):
        return env[ENV_MEM_ROOT]
    return MEM_ROOT_DEFAULT if os.path.isdir(MEM_ROOT_DEFAULT) else tempfile.gettempdir()


def scratch_tag(tag: str) -> str:
    """A job's tag as node-local scratch directories are named by it: as it is when of the form
    a sweep knows; a tag of another form (a job id made by hand: a separator, `..`, a NUL, too
    long) by its hash (12 hex digits), the same for every caller."""
    if _MEM_TAG.fullmatch(tag):
        return tag
    return hashlib.sha1(tag.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def mem_dir(root: str | os.PathLike, tag: str) -> str:
    """`<root>/es-mem-<tag>`: one directory right under `root`, of the form a sweep knows."""
    return os.path.join(root, MEM_PREFIX + scratch_tag(tag))


def hold_mem_dir(path: str | os.PathLike) -> int:
    """Create `path` (0700) if needed and hold it shared for as long as the returned descriptor
    stays open (not inherited by children)."""
    lock = os.path.join(path, LOCK_FILE)
    for _ in range(5):  # a sweep may remove the directory between our open and our lock
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(f"{path} keeps being removed while it is taken")


def take_if_abandoned(path: str | os.PathLike) -> int | None:
    """An exclusive hold on `path` when no live process holds it (its owner died), else None."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError:
        return None
    if fd is None:  # never held (or its lock file gone): nobody can be holding it
        try:
            fd = os.open(
                os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        except OSError:
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


# --- stacks on a hang or no-progress finding ------------------------------------------------------
# Before tearing an attempt down for a `hang` or `no_progress`, the supervisor has each rank's
# Python stacks (all threads) written to `ES_ATTEMPT_DIR/stacks/rank-<R>.txt`: a rank that can still
# run dumps its own on STACKS_SIGNAL (faulthandler, registered at start); one that cannot (stopped,
# in D state) is read from outside. No other part of the job may use this signal.
STACKS_SIGNAL = signal.SIGUSR2
STACKS_DIR = "stacks"


def stacks_path(attempt_dir: str | os.PathLike, rank: int) -> str:
    return os.path.join(attempt_dir, STACKS_DIR, f"rank-{rank}.txt")


# --- ranks -> supervisor: messages --------------------------------------------------------------
VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024

KINDS = frozenset({"hello", "beat", "step", "phase", "ckpt", "resumed", "error", "done", "summary"})
PHASES = ("init", "standby", "load", "train", "save", "done")
# `memory`: this rank's copy of that step into the memory tier is sealed (every rank says it;
# at most one a heartbeat interval each: worker.beat). The others are rank 0's durable saves.
CKPT_STATES = frozenset({"staged", "written", "complete", "memory"})
# Where a `resumed` rank's state came from (its optional `source`; absent without a memory tier).
RESUME_SOURCES = frozenset({"memory", "durable"})
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
    "phase": {"phase": str, "step": int},  # + `prepared` (str) when the phase is standby
    "ckpt": {"step": int, "state": str},
    # + `source` (str): RESUME_SOURCES; + `why` (str, at most MAX_WHY): what the memory tier
    # passed over and why (a slot a rank refused, naming the rank)
    "resumed": {"step": int, "restart_seconds": NUMBER},
    "error": {"message": str},
    "done": {"step": int},
    # A node's relay (sent as the relay's own rank), run-length coded (a node's ranks are mostly
    # consecutive and step together): `node` (its name), `ranks` ([first, count] runs, ascending:
    # every rank of the node heard from, the relay's own included), `steps` ([step, count] runs
    # in that rank order: each one's latest step), `phases` (one str when they all share it, else
    # [phase, count] runs), `late` ([rank, age_s] for each rank not heard from since the relay's
    # previous summary: its last message is `age_s` old; every other one was heard from since).
    "summary": {"node": str, "ranks": list, "steps": list, "phases": (str, list), "late": list},
}
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


def decode(key: bytes, frame: bytes, job: str | None = None) -> dict[str, Any]:
    """Check size, signature and schema; return the message or raise BadMessage."""
    if len(frame) <= MAC_LEN:
        raise BadMessage(f"a frame of {len(frame)} bytes holds no signed message", "frames")
    if len(frame) > MAC_LEN + MAX_MESSAGE_BYTES:
        raise BadMessage(f"oversized message ({len(frame) - MAC_LEN} bytes)", "oversized")
    mac, body = frame[:MAC_LEN], frame[MAC_LEN:]
    if not hmac.compare_digest(sign(key, body), mac):
        raise BadMessage("bad signature", "signature")
    try:
        message = json.loads(body.decode())
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        raise BadMessage(f"not JSON: {exc}", "json") from None
    if not isinstance(message, dict):
        raise BadMessage("not a JSON object", "json")
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


# --- supervisor -> ranks: control (fault injection, standby) -------------------------------------
# Optional: the ZeroMQ address of the supervisor's control socket (a ROUTER). Set when the job
# declares faults or keeps a standby; a rank connects a DEALER whose routing id is
# `control_identity(...)`.
ENV_CONTROL_ADDR = "ES_CONTROL_ADDR"
# signal: the rank signals itself (`signal` = the number); stall: it blocks inside its next step
# while its beat thread keeps beating; slow: it sleeps `delay_s` per step for `duration_s`.
# go / exit: a standby rank resumes and trains / ends (`fault` is 0 for both).
CONTROL_ACTIONS = frozenset({"signal", "stall", "slow", "go", "exit"})
STANDBY_ACTIONS = frozenset({"go", "exit"})
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
}
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
    if (message["job"], message["attempt"], message["rank"]) != (job, attempt, rank):
        raise BadMessage("a control message for another rank, attempt or job", "other_job")
    return message
