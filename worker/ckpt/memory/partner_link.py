"""Partner copies while training: each rank sends every sealed copy of its own to its holder (a
rank on the next node, `partners.holders`) over ZeroMQ, and holds the copies its wards send.

Never on the training critical path: the copy thread hands the sealed slot to a sender thread
and returns; the sender sends straight from the slot's mapping (no extra copy) and keeps one copy
on its way at a time, so a copy sealed while the previous is still on its way is skipped, counted
and said (a slow or gone partner costs copies, never steps). The slot may be written again
while it is sent (two copies on); such a copy is held torn in its bytes, and the fetch, which
checks every tensor's digest before a load, refuses it. The receiver takes a copy's bytes
straight into the slot they are held in. ZeroMQ's I/O thread, which does the network's work of
both (and holds no GIL), runs at the lowest priority: on a node whose cores the training keeps
busy, copies use what it leaves idle first.

A message is two frames: the HMAC-SHA256 (a key rank 0 draws for the run) of a JSON header, then
the header (the ward's sealed record and the copy's number, counted up by its sender: a signed
header sent again, as a replay would, is refused); then the copy's raw bytes, whose digests in
the record catch damage, not a forgery. Nothing is unpickled. Whatever arrives (from a
stranger, or malformed) is refused with a reason and counted; nothing it holds stops the
receiver. The link has a ZeroMQ context of its own: once closed, no socket and no thread of it
is left.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from worker import collectives, lease
from worker.ckpt.fail_points import SaveFailPoints
from worker.ckpt.memory.partner_copy import Incoming, PartnerStore
from worker.ckpt.memory.partners import held_on, holders
from worker.ckpt.memory.slot_file import MAX_RECORD_BYTES, Expect, SlotRefused
from worker.ckpt.memory.thread_cpu import ThreadCpu

MAC_BYTES = 64  # hex HMAC-SHA256
POLL_MS = 200  # how often the receiver looks whether it is to stop
SEND_HWM = 2  # messages queued towards the holder before a send would block: it is skipped
CLOSE_WAIT_S = 30.0  # at most, for the receiver to finish holding a copy when the link closes
INT_MAX = (1 << 31) - 1  # the most `recv_into` receives into a buffer
NICE = 19  # ZeroMQ's I/O thread of the link: the lowest priority
# The link's context names its threads `19/ZMQbg/...`: only those are lowered, never a thread
# another part of the process starts meanwhile (a Python thread, another context's I/O thread).
THREAD_PREFIX = 19
NAME_WAIT_S = 1.0  # at most, for the context's threads to have named themselves


@dataclass(frozen=True)
class PartnerStats:
    """Counts since the link opened; `seconds`/`nbytes` of the copies sent."""

    sent: int
    skipped: int
    received: int
    refused: int
    seconds: float
    nbytes: int
    last_refusal: str | None
    last_skip: str | None


def _sign(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def _receive_into(pull: zmq.Socket, view: memoryview) -> int:
    """The next frame's bytes into `view`, straight from ZeroMQ's buffer; the frame's size (a
    larger frame is cut at `view`'s end). `recv_into` counts in a C int: a copy of 2 GiB or
    more is taken as a frame and copied over."""
    if len(view) < INT_MAX:
        return pull.recv_into(view)
    frame = pull.recv(copy=False)
    if len(frame) == len(view):
        view[:] = frame.buffer
    return len(frame)


def _tasks() -> set[int]:
    """This process's threads (Linux); none where there is no /proc."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _named(tids: set[int], prefix: str) -> set[int]:
    """Those of `tids` whose thread name starts with `prefix` (one gone meanwhile: not)."""
    named = set()
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(prefix):
                    named.add(tid)
        except OSError:
            pass
    return named


def _started_threads(before: set[int], prefix: str, count: int) -> set[int]:
    """The threads started since `before` whose name starts with `prefix`, once there are
    `count` (a thread names itself as it starts), or as many as there are after NAME_WAIT_S."""
    deadline = time.monotonic() + NAME_WAIT_S
    while True:
        named = _named(_tasks() - before, prefix)
        if len(named) >= count or time.monotonic() > deadline:
            return named
        time.sleep(0.001)


def _yield_cpu(tids: set[int]) -> None:
    """Lowest priority (nice 19) for these threads: ZeroMQ's own, which do the network's work
    of a copy and hold no GIL, so that a core the training leaves idle does it first."""
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
        except OSError:  # gone, or not allowed: it runs at the process's priority
            pass


class PartnerLink:
    """This rank's two ends: a PULL socket its wards send to (a receiver thread holds what
    comes), and a PUSH socket to its holder (a sender thread, one copy on its way at a time)."""

    def __init__(
        self,
        store: PartnerStore | None,
        bind_host: str | None,
        max_bytes: int,
        cpu: ThreadCpu | None = None,
    ):
        self.store = store
        self.cpu = cpu if cpu is not None else ThreadCpu()  # its threads', ZeroMQ's included
        self.ctx = zmq.Context()
        self.max_bytes = max_bytes
        self._started = False  # the context's I/O thread: it starts with the first socket
        self.key = b""
        self._stop = threading.Event()
        self._busy = threading.Lock()
        self._counting = threading.Lock()  # the counts are bumped from the loop and the sender
        self.sent = self.skipped = self.received = self.refused = self.nbytes = 0
        self.seconds = 0.0
        self.last_refusal: str | None = None
        self.last_skip: str | None = None
        self.endpoint: str | None = None
        self._seq = 0  # the number of this rank's last copy sent (in its signed header)
        self._seen: dict[Any, int] = {}  # per ward: the number of the last copy taken in
        self.no_holder: str | None = None  # why this rank's copies have nowhere to go
        self._pull = self._push = None
        self._threads: list[threading.Thread] = []
        if store is None or bind_host is None:
            return
        pull = self._socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        pull.setsockopt(zmq.RCVHWM, SEND_HWM)  # per sender: what waits here to be held
        try:
            port = pull.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError:
            pull.close()
            return
        self._pull, self.endpoint = pull, f"tcp://{bind_host}:{port}"

    def start(self, key: bytes, holder_endpoint: str | None, holder: int | None = None) -> None:
        """Begin receiving (when this rank holds copies) and connect to the holder (when it
        has one that could bind; else each copy offered is skipped, saying so)."""
        self.key = key
        if self._pull is not None:
            self._spawn(self._receive_loop, "mem-partner-recv")
        if holder is not None and not holder_endpoint:
            self.no_holder = f"its partner (rank {holder}) has no address to receive at"
        if holder_endpoint:
            push = self._socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, SEND_HWM)
            push.connect(holder_endpoint)
            self._push = push

    def _socket(self, kind: int) -> zmq.Socket:
        """A socket of the link's context; with the first, the threads the context starts (its
        I/O thread: a copy's sends and receipts), known by their name, are lowered
        (`_yield_cpu`)."""
        if self._started:
            return self.ctx.socket(kind)
        try:  # threads started between the two looks are not all the context's: by name
            self.ctx.set(zmq.THREAD_NAME_PREFIX, THREAD_PREFIX)
            prefix = f"{THREAD_PREFIX}/ZMQbg/"
        except (AttributeError, zmq.ZMQError):  # a libzmq without it: its default names
            prefix = "ZMQbg/"
        before = _tasks()
        sock = self.ctx.socket(kind)
        self._started = True
        if before:  # else no /proc: they run at the process's priority
            started = _started_threads(before, prefix, self.ctx.get(zmq.IO_THREADS) + 1)
            _yield_cpu(started)
            self.cpu.add(started)
        return sock

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---- sending ---------------------------------------------------------------------------------
    def offer(self, record: dict[str, Any], data: torch.Tensor) -> None:
        """A sealed copy of this rank's (`data`: its bytes, the slot's mapping): sent in the
        background when the previous one is on its way no more, else skipped."""
        if self._push is None or self._stop.is_set():
            if self.no_holder:
                self._skip(record, self.no_holder)
            return
        if not self._busy.acquire(blocking=False):
            self._skip(record, "the copy before it was still on its way")
            return
        threading.Thread(
            target=self._send, args=(record, data), name="mem-partner-send", daemon=True
        ).start()

    def _send(self, record: dict[str, Any], data: torch.Tensor) -> None:
        self.cpu.add_current()
        try:
            started = time.perf_counter()
            self._seq += 1  # one sender thread at a time (`_busy`)
            body = json.dumps({"record": record, "seq": self._seq}, separators=(",", ":"))
            body = body.encode()
            frames = [_sign(self.key, body) + body, memoryview(data.numpy())]
            lease.guard()  # a fenced rank sends its partner nothing more
            try:
                tracker = self._push.send_multipart(
                    frames, flags=zmq.NOBLOCK, copy=False, track=True
                )
            except zmq.Again:
                self._skip(record, "its partner takes no more copies")
                return
            except zmq.ZMQError as exc:  # closed meanwhile, or no send at all
                if not self._stop.is_set():
                    self._skip(record, f"it could not be sent ({exc})")
                return
            while not self._stop.is_set():
                try:
                    tracker.wait(0.5)
                    break
                except zmq.NotDone:
                    continue
            else:
                return
            with self._counting:
                self.sent += 1
                self.nbytes += data.numel()
                self.seconds += time.perf_counter() - started
        finally:
            self.cpu.retire_current()
            self._busy.release()

    def _skip(self, record: dict[str, Any], why: str) -> None:
        with self._counting:
            self.skipped += 1
            self.last_skip = f"step {record['step']}: {why}"

    # ---- receiving -------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        """Until `close`: hold what comes. This thread owns the receiving socket and the store
        (it closes both as it ends, a copy being held finished first)."""
        pull = self._pull
        self.cpu.add_current()
        try:
            while not self._stop.is_set():
                try:
                    if not pull.poll(POLL_MS):
                        continue
                    problem = self._hold(pull, pull.recv())
                except zmq.ZMQError:
                    return
                with self._counting:
                    if problem:
                        self.refused += 1
                        self.last_refusal = problem[:400]
                    else:
                        self.received += 1
        finally:
            self.cpu.retire_current()
            pull.close(linger=0)
            if self.store is not None:
                self.store.close()

    def _hold(self, pull: zmq.Socket, head: bytes) -> str | None:
        """One message, its first frame `head` taken: the header checked, then the copy's bytes
        received straight into the slot they go into (dropped when the header is refused),
        every frame of the message taken, then the slot sealed."""
        incoming, problem, frames, received = None, None, 1, 0
        if pull.get(zmq.RCVMORE):
            incoming, problem = self._admit(head)
            frames += 1
            if incoming is not None:
                received = _receive_into(pull, incoming.view)
            else:
                pull.recv(copy=False)
        while pull.get(zmq.RCVMORE):
            pull.recv(copy=False)
            frames += 1
        if frames != 2:
            return f"{frames} frames, not a copy's 2"
        if problem:
            return problem
        try:
            self.store.seal(incoming, received)
        except SlotRefused as exc:
            return str(exc)
        except Exception as exc:  # whatever came, the receiver goes on
            return f"could not be held ({type(exc).__name__}: {exc})"
        return None

    def _admit(self, head: bytes) -> tuple[Incoming | None, str | None]:
        """A copy's header checked and its slot opened (`PartnerStore.open`); or why not."""
        if len(head) > MAC_BYTES + MAX_RECORD_BYTES:
            return None, "an oversized header"
        mac, body = head[:MAC_BYTES], head[MAC_BYTES:]
        if not hmac.compare_digest(_sign(self.key, body), mac):
            return None, "a header not signed with this run's key"
        try:
            message = json.loads(body)
            record, seq = message.get("record"), message.get("seq")
            ward = record.get("rank") if isinstance(record, dict) else None
            if type(seq) is not int or type(ward) is not int:
                return None, "a header without its copy's rank and number"
            if seq <= self._seen.get(ward, 0):  # signed, but taken in before: sent again
                return None, f"rank {ward}'s copy number {seq} once more (a replay)"
            self._seen[ward] = seq
            return self.store.open(record, self.max_bytes), None
        except (ValueError, AttributeError, RecursionError) as exc:
            return None, f"an unreadable header ({str(exc)[:200]})"
        except SlotRefused as exc:
            return None, str(exc)
        except OSError as exc:
            return None, f"could not be held ({exc.strerror or exc})"
        except Exception as exc:  # whatever came, the receiver goes on
            return None, f"could not be held ({type(exc).__name__}: {exc})"

    def stats(self) -> PartnerStats:
        with self._counting:
            return self._stats()

    def _stats(self) -> PartnerStats:
        return PartnerStats(
            self.sent,
            self.skipped,
            self.received,
            self.refused,
            self.seconds,
            self.nbytes,
            self.last_refusal,
            self.last_skip,
        )

    def close(self) -> None:
        """Stop both ends: the receiver ends after the copy it is holding (if any), a send on
        its way gives up at its next look; then the sockets and the context go."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=CLOSE_WAIT_S)
        with self._busy:  # a send on its way gives up at its next look
            pass
        if self._push is not None:
            self._push.close(linger=0)
        if not self._threads and self._pull is not None:  # bound, never started
            self._pull.close(linger=0)
            if self.store is not None:
                self.store.close()
        if not any(t.is_alive() for t in self._threads):  # else its socket is still open
            self.ctx.term()


def bind_host(hosts: list[str], toward: str | None = None) -> str | None:
    """Loopback when every rank runs on this one host (emulated nodes, one node); else this
    host's address as its name resolves, unless that is a loopback one (Debian's `127.0.1.1`
    line in /etc/hosts) or does not resolve: then the address this host reaches `toward` from
    (the rendezvous host, MASTER_ADDR). None when there is none: this rank holds no copies."""
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    try:
        address = socket.gethostbyname(socket.getfqdn())
    except OSError:
        address = None
    if address is not None and not ipaddress.ip_address(address).is_loopback:
        return address
    return _route_to(toward)


def _route_to(host: str | None) -> str | None:
    """The local address of the route to `host` (a UDP socket's connect sends nothing); None
    for no host, a loopback one, or no route."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def connect_partners(
    job_dir: Path,
    expect: Expect,
    node: str,
    own_nbytes: int,
    hooks: SaveFailPoints,
    cpu: ThreadCpu | None = None,
) -> tuple[PartnerLink | None, int]:
    """Collective, at the memory tier's first copy: every rank's node; when the ranks span two
    nodes or more, each rank binds its receiver, rank 0 draws the run's key, and every rank
    connects to its holder. Returns the link (None on one node) and how many ranks of other
    nodes this node holds copies of, all its ranks together (with uneven nodes, not its own
    number of ranks: a node of one rank after a node of three holds three)."""
    here = {"node": node, "host": socket.gethostname()}
    every = collectives.all_gather_json(here)
    holder = holders([e["node"] for e in every])
    if holder[expect.rank] is None:
        return None, 0
    wards = {r for r, h in enumerate(holder) if h == expect.rank}
    store = PartnerStore(job_dir, expect, expect.rank, node, hooks, wards) if wards else None
    address = bind_host([e["host"] for e in every], os.environ.get("MASTER_ADDR"))
    link = PartnerLink(store, address, 2 * own_nbytes + (16 << 20), cpu)
    key = collectives.broadcast_json(secrets.token_hex(32) if expect.rank == 0 else None)
    endpoints = collectives.all_gather_json(link.endpoint)
    link.start(key.encode(), endpoints[holder[expect.rank]], holder[expect.rank])
    return link, held_on([e["node"] for e in every], node)
