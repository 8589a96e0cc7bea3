"""One relay per node: its ranks' beats and steps in one signed summary per interval.

With `ES_HEARTBEAT_RELAY=1` and more than one rank on a node, local rank 0's beat thread doubles
as its node's relay (worker.beacon_relay): it binds a node-local socket (`relay_address`), the
node's other ranks send it everything they would send the supervisor, and it

- folds their `beat`s (and the `step`s of ranks other than 0, which only move a step) into one
  record per rank, and sends the supervisor one `summary` per interval, signed like a beat, in
  place of every rank's own beats: the supervisor's work grows with nodes, not ranks;
- forwards every other message (hello, phase, rank 0's steps, ckpt, resumed, error, done) as it
  came, signed by its rank, in the order received: the facts the supervisor turns into events
  arrive as they did, and never behind a summary that is newer than them.

A summary is whole (every rank of the node heard from, each one's step and phase), never a delta:
a lost summary loses only its own freshness. Compact where it pays: ranks, steps and phases are
run-length coded (a node's ranks are consecutive and step together: a few runs each, whatever the
node's size), and ranks heard from since the previous summary are implied fresh; only the others
are listed (`late`, with the age of their last message), so a single silent rank is still named,
with its own last-seen time. A relay that stops (its rank killed or stopped) stops its node's
summaries: the supervisor judges that as the failure of its node and names all of its ranks.

This module must not import torch, nor zmq at import (an unsupervised rank never loads it).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from contracts import env_names, messages

node_name = env_names.node_name  # the node's name, as the launcher gives it


def relay_address(key: bytes, job: str, attempt: int, node: str) -> str:
    """The node-local address of a node's relay for one attempt. Linux: an abstract socket (no
    file to leave behind when the relay dies); elsewhere a socket file in the temp dir. The name
    is a hash keyed by the job's secret: nobody else can guess it to squat on it (and every
    frame is verified anyway)."""
    tag = hashlib.sha256(key + f"\0{job}\0{attempt}\0{node}".encode()).hexdigest()[:24]
    if sys.platform.startswith("linux"):
        return f"ipc://@es-relay-{tag}"
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'es-relay-{tag}')}"


@dataclass(slots=True)
class _Rank:
    phase: str
    step: int
    heard: float  # monotonic, on the relay's clock
    fresh: bool  # heard from since the previous summary
    compute: float | None = None  # its latest step's compute seconds (stragglers)


class RelayCore:
    """The relay's state, without sockets: frames in (`take`, `own`), summaries out (`summary`).
    The beat thread owns it; the benchmark drives the same object."""

    def __init__(self, key: bytes, identity: messages.RankIdentity, node: str) -> None:
        self.key = key
        self.id = identity
        self.node = node
        self.ranks: dict[int, _Rank] = {}
        self.dropped = 0  # frames from the node that failed verification (or of another attempt)
        self.forwarded = 0
        self.summaries = 0

    def take(self, frame: bytes, now: float) -> bytes | None:
        """A frame from one of the node's ranks: verify and fold it; return it when it must be
        forwarded as it is (None: summarized, or dropped)."""
        try:
            msg = messages.decode(self.key, frame, self.id.job)
        except messages.BadMessage:
            self.dropped += 1
            return None
        if msg["attempt"] != self.id.attempt or msg["kind"] == "summary":
            self.dropped += 1
            return None
        kind = msg["kind"]
        self.fold(msg["rank"], kind, msg, now)
        if kind == "beat" or (kind == "step" and msg["rank"] != 0):
            return None
        self.forwarded += 1
        return frame

    def own(self, kind: str, fields: dict[str, Any], now: float) -> None:
        """What the relay's own rank says (its beats are summarized; the rest it sends itself)."""
        self.fold(self.id.rank, kind, fields, now)

    def fold(self, rank: int, kind: str, msg: dict[str, Any], now: float) -> None:
        r = self.ranks.get(rank)
        if r is None:
            r = self.ranks[rank] = _Rank("init", 0, now, True)
        r.heard, r.fresh = now, True
        if kind in ("beat", "phase", "hello"):
            r.phase = msg["phase"]
        if kind in ("beat", "step", "phase"):
            r.step = msg["step"]
        if "compute" in msg and kind in ("beat", "step"):
            r.compute = msg["compute"]
        elif kind == "done":
            r.phase, r.step = "done", msg["step"]

    def summary(self, t: float, now: float) -> dict[str, Any] | None:
        """The node's summary now (None before any rank was heard from); marks every rank
        unheard until its next message."""
        if not self.ranks:
            return None
        order = sorted(self.ranks)
        recs = [self.ranks[r] for r in order]
        phases = messages.runs([r.phase for r in recs])
        late = [
            [k, round(now - r.heard, 3)] for k, r in zip(order, recs, strict=True) if not r.fresh
        ]
        for r in recs:
            r.fresh = False
        self.summaries += 1
        timing = {}
        if any(r.compute is not None for r in recs):  # each rank's, in rank order (0.1 ms)
            timing["compute"] = [None if r.compute is None else round(r.compute, 4) for r in recs]
        return self.id.message(
            "summary",
            t,
            node=self.node,
            ranks=messages.rank_runs(order),
            steps=messages.runs([r.step for r in recs]),
            phases=phases[0][0] if len(phases) == 1 else phases,
            late=late,
            **timing,
        )

    def summary_frame(self, t: float, now: float) -> bytes | None:
        """The summary, signed; without its `compute` when that would make it oversized."""
        msg = self.summary(t, now)
        if msg is None:
            return None
        frame = messages.encode(self.key, msg)
        if len(frame) > messages.MAC_LEN + messages.MAX_MESSAGE_BYTES and "compute" in msg:
            del msg["compute"]
            frame = messages.encode(self.key, msg)
        return frame
