"""Partner copies against hostile or broken input: whatever reaches a rank's partner port (a
stranger, a malformed message, a copy of a rank it does not hold), whatever lies in the partner
directory (junk names, links, FIFOs), and a link closed while it works. Nothing stops the
receiver or shows a traceback, nothing damaged is held, each refusal is one line, and a closed
link leaves no thread or socket."""

from __future__ import annotations

import _thread
import json
import os
import threading
import time
from dataclasses import replace

import pytest
import torch
import zmq

from tests.unit.test_partner_copies import EXPECT, NBYTES, copy_of, holder_store, wait_for
from worker.ckpt import memory
from worker.ckpt.memory import partner_copy, partner_link, partners
from worker.hooks import Hooks

KEY = b"k" * 64
NICE = partner_link.NICE
HOLDER = replace(EXPECT, rank=2, host="n2")


@pytest.fixture
def tracebacks(monkeypatch):
    """What would have printed a thread's traceback."""
    seen: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: seen.append(repr(a.exc_value)))
    return seen


@pytest.fixture
def holder(tmp_path):
    """Rank 2, the holder of rank 1's copies only."""
    store = memory.PartnerStore(tmp_path, HOLDER, 2, "n2", Hooks(), wards={1})
    link = partner_link.PartnerLink(store, "127.0.0.1", 1 << 20)
    link.start(KEY, None)
    yield link
    link.close()


def signed(body: bytes, key: bytes = KEY) -> bytes:
    return partner_link._sign(key, body) + body


_numbers = iter(range(1, 1 << 30))


def of_record(record, seq: int | None = None) -> bytes:
    """A signed header of `record`, numbered after every one before (or `seq`)."""
    seq = next(_numbers) if seq is None else seq
    return signed(json.dumps({"record": record, "seq": seq}).encode())


def send_each(endpoint: str, messages: list[list[bytes]]) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(endpoint)
    for frames in messages:
        push.send_multipart(frames)
    push.close()
    ctx.term()


def test_whatever_comes_is_refused_in_one_line_and_the_receiver_goes_on(holder, tracebacks):
    record, data = copy_of(5)
    raw = data.numpy().tobytes()
    stranger_s = memory.checked({**record, "rank": 3})  # sealed right, but not a ward of rank 2
    hostile = [
        ([b"x"], "1 frames, not a copy's 2"),
        ([b"a", b"b", b"c"], "3 frames"),
        ([b"short", b""], "not signed with this run's key"),
        ([signed(b"{}", b"x" * 64), raw], "not signed with this run's key"),
        ([signed(b"[1, 2]"), raw], "an unreadable header"),
        ([signed(b"\xff\xfe"), raw], "an unreadable header"),
        ([signed(b"[" * 100_000 + b"]" * 100_000), raw], "an unreadable header"),
        ([signed(json.dumps({"record": record}).encode()), raw], "without its copy's rank"),
        ([of_record("a string"), raw], "a header without its copy's rank and number"),
        ([of_record(memory.checked({**record, "rank": True})), raw], "without its copy's rank"),
        ([of_record({**record, "rank": -1}), raw], "a copy of rank -1"),
        ([of_record({**record, "rank": 10**30}), raw], "a copy of rank 1000000"),
        ([of_record(stranger_s), raw], "a copy of rank 3, not one this rank holds"),
        ([of_record(record), raw[:-1]], f"{NBYTES - 1} bytes received"),
        ([of_record({**record, "nbytes": 1 << 50}), raw], "fails its checksum"),
        ([of_record(memory.checked({**record, "nbytes": 2 << 20})), raw], "over the 1048576"),
        ([of_record(memory.checked({**record, "nbytes": "x"})), raw], "no size in its record"),
        ([of_record(record), raw + b"x"], f"{NBYTES + 1} bytes received"),  # cut at the slot
        ([of_record(record), raw, b""], "3 frames"),
    ]
    for frames, says in hostile:
        before = holder.stats().refused
        send_each(holder.endpoint, [frames])
        wait_for(lambda b=before: holder.stats().refused == b + 1, what=holder.stats)
        said = holder.stats().last_refusal
        assert says in said and "\n" not in said and len(said) <= 400, (says, said)
    send_each(holder.endpoint, [[of_record(record), raw]])
    wait_for(lambda: holder.stats().received == 1, what=holder.stats)
    assert not tracebacks
    held = memory.find_held(holder.store.directory.parent, HOLDER)
    assert list(held) == [1] and [h.step for h in held[1]] == [5]


def test_a_signed_copy_sent_again_is_refused_as_a_replay(holder):
    """Someone who saw a copy go by sends its signed header again, its bytes changed so that
    every page sums the same (two words swapped: the digests, made to catch damage, pass)."""
    record, data = copy_of(5)
    header = of_record(record, seq=7)
    send_each(holder.endpoint, [[header, data.numpy().tobytes()]])
    wait_for(lambda: holder.stats().received == 1, what=holder.stats)
    forged = data.clone()
    words = forged[:8192].view(torch.int64)
    words[[0, 1]] = words[[1, 0]].clone()
    assert bool((forged != data).any())
    assert partner_copy.bytes_problem(record["table"], forged) is None
    for seq_header in (header, of_record(record, seq=6)):
        send_each(holder.endpoint, [[seq_header, forged.numpy().tobytes()]])
        wait_for(lambda: holder.stats().refused >= 1, what=holder.stats)
    wait_for(lambda: holder.stats().refused == 2, what=holder.stats)
    assert "rank 1's copy number 6 once more (a replay)" in holder.stats().last_refusal
    (held,) = memory.find_held(holder.store.directory.parent, HOLDER)[1]
    assert held.path.read_bytes()[4096 : 4096 + NBYTES] == data.numpy().tobytes()


def test_an_oversized_message_drops_its_sender_not_the_receiver(holder, tracebacks):
    record, data = copy_of(5)
    send_each(holder.endpoint, [[b"x" * 64, b"\0" * (2 << 20)]])  # over the 1 MiB limit
    send_each(holder.endpoint, [[of_record(record), data.numpy().tobytes()]])
    wait_for(lambda: holder.stats().received == 1, what=holder.stats)
    assert holder.stats().refused == 0 and not tracebacks


def test_a_closed_link_leaves_no_thread_and_no_socket(tmp_path):
    holder = partner_link.PartnerLink(holder_store(tmp_path), "127.0.0.1", 1 << 20)
    sender = partner_link.PartnerLink(None, "127.0.0.1", 1 << 20)
    holder.start(KEY, None)
    sender.start(KEY, holder.endpoint, 2)
    sender.offer(*copy_of(5))
    wait_for(lambda: holder.stats().received == 1, what=holder.stats)
    for link in (sender, holder):
        link.close()
        assert link.ctx.closed
    assert not [t.name for t in threading.enumerate() if t.name.startswith("mem-partner")]


def test_a_link_closed_while_it_holds_a_copy_finishes_that_copy_first(tmp_path, tracebacks):
    store = holder_store(tmp_path)
    seal, entered = store.seal, threading.Event()

    def slow(incoming, received):
        entered.set()
        time.sleep(0.6)  # longer than the receiver's poll: close used to pull the slot away
        return seal(incoming, received)

    store.seal = slow
    holder = partner_link.PartnerLink(store, "127.0.0.1", 1 << 20)
    holder.start(KEY, None)
    record, data = copy_of(5)
    send_each(holder.endpoint, [[of_record(record), data.numpy().tobytes()]])
    assert entered.wait(10)
    holder.close()
    assert holder.stats().received == 1 and holder.stats().refused == 0 and not tracebacks
    assert holder.ctx.closed
    assert [h.step for h in memory.find_held(tmp_path, HOLDER)[1]] == [5]


def test_a_copy_of_2_gib_or_more_is_received_through_a_frame(holder, monkeypatch):
    """`recv_into` counts in a C int: at INT_MAX bytes or more, the copy goes through a frame
    (INT_MAX lowered here so that a small copy takes that path)."""
    monkeypatch.setattr(partner_link, "INT_MAX", 1024)
    record, data = copy_of(5)
    for sent in (data.numpy().tobytes()[:-1], data.numpy().tobytes()):
        send_each(holder.endpoint, [[of_record(record), sent]])
    wait_for(lambda: holder.stats().received == 1, what=holder.stats)
    assert f"{NBYTES - 1} bytes received" in holder.stats().last_refusal
    (held,) = memory.find_held(holder.store.directory.parent, HOLDER)[1]
    assert held.path.read_bytes()[4096 : 4096 + NBYTES] == data.numpy().tobytes()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads listed in /proc")
def test_the_link_s_network_thread_yields_the_cpu_and_no_python_thread_does(tmp_path):
    before = {int(t) for t in os.listdir("/proc/self/task")}
    holder = partner_link.PartnerLink(holder_store(tmp_path), "127.0.0.1", 1 << 20)
    try:
        holder.start(KEY, None)
        new = {int(t) for t in os.listdir("/proc/self/task")} - before
        python = {t.native_id for t in threading.enumerate()}
        nice = {t: os.getpriority(os.PRIO_PROCESS, t) for t in new}
        assert [n for t, n in nice.items() if t not in python] and all(
            n == partner_link.NICE for t, n in nice.items() if t not in python
        )
        assert all(n == os.getpriority(os.PRIO_PROCESS, 0) for t, n in nice.items() if t in python)
    finally:
        holder.close()


def _nice_by_name(tids: set[int]) -> dict[int, tuple[str, int]]:
    out = {}
    for tid in tids:
        with open(f"/proc/self/task/{tid}/comm") as f:
            out[tid] = (f.read().strip(), os.getpriority(os.PRIO_PROCESS, tid))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads listed in /proc")
def test_threads_started_elsewhere_meanwhile_keep_their_priority(tmp_path, monkeypatch):
    """While the link's context starts its threads, another part of the process starts its own
    (a native thread `threading` does not know yet, another context's I/O thread, as the
    heartbeat's): only the link's, known by their name, are lowered."""
    plain, release, foreign = zmq.Context, threading.Lock(), []
    release.acquire()

    class Busy(plain):
        def socket(self, kind, **kwargs):
            if not foreign:
                _thread.start_new_thread(release.acquire, ())
                other = plain()
                foreign.append((other, other.socket(zmq.PUSH)))
            return super().socket(kind, **kwargs)

    monkeypatch.setattr(partner_link.zmq, "Context", Busy)
    before = set(partner_link._tasks())
    holder = partner_link.PartnerLink(holder_store(tmp_path), "127.0.0.1", 1 << 20)
    try:
        seen = _nice_by_name(partner_link._tasks() - before)
        others = {t: n for t, (n, _) in seen.items() if not n.startswith("19/ZMQbg/")}
        assert len(others) >= 3, seen  # the foreign thread and the other context's two
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(seen[t][1] == base for t in others), seen
        ours = {n: nice for t, (n, nice) in seen.items() if t not in others}
        assert ours == {"19/ZMQbg/IO/0": NICE, "19/ZMQbg/Reaper": NICE}, seen
    finally:
        holder.close()
        release.release()
        for other, sock in foreign:
            sock.close()
            other.term()


@pytest.mark.parametrize("missing", ["/proc", "the right to renice"])
def test_without_proc_or_the_right_to_renice_the_link_works(tmp_path, monkeypatch, missing):
    def refused(*_):
        raise PermissionError(1, "not allowed")

    if missing == "/proc":
        monkeypatch.setattr(partner_link, "_tasks", set)
    else:
        monkeypatch.setattr(partner_link.os, "setpriority", refused)
    holder = partner_link.PartnerLink(holder_store(tmp_path), "127.0.0.1", 1 << 20)
    try:
        holder.start(KEY, None)
        record, data = copy_of(5)
        send_each(holder.endpoint, [[of_record(record), data.numpy().tobytes()]])
        wait_for(lambda: holder.stats().received == 1, what=holder.stats)
    finally:
        holder.close()


def test_a_holder_without_an_address_is_said_as_a_skipped_copy():
    sender = partner_link.PartnerLink(None, "127.0.0.1", 1 << 20)
    try:
        sender.start(KEY, None, 3)
        sender.offer(*copy_of(5))
        assert sender.stats().skipped == 1
        assert "its partner (rank 3) has no address to receive at" in sender.stats().last_skip
    finally:
        sender.close()


# --- the partner directory ------------------------------------------------------------------
def held_copy(tmp_path, step: int = 5):
    store = holder_store(tmp_path)
    store.receive(*(lambda r, d: (r, memoryview(d.numpy())))(*copy_of(step)))
    store.close()


def test_junk_in_the_partner_directory_is_passed_over(tmp_path):
    held_copy(tmp_path)
    top = partner_copy.partner_dir(tmp_path)
    for name in ("rank-abc", "rank-999999999999", "rank-", "rank--1", "rank-01", "rank-²", "x"):
        (top / name).mkdir()
    (top / "rank-0").write_text("not a directory")
    os.mkfifo(top / "rank-3")
    assert list(memory.find_held(tmp_path, HOLDER)) == [1]
    os.rename(top / "rank-1", tmp_path / "elsewhere")  # the copy itself, behind a link
    os.symlink(tmp_path / "elsewhere", top / "rank-1")
    assert memory.find_held(tmp_path, HOLDER) == {}


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_slot_file_that_is_a_link_or_a_fifo_is_never_read(tmp_path, plant):
    held_copy(tmp_path)
    json_path = partner_copy.partner_dir(tmp_path) / "rank-1" / "slot-0.json"
    moved = tmp_path / "moved.json"
    os.rename(json_path, moved)
    os.symlink(moved, json_path) if plant == "symlink" else os.mkfifo(json_path)
    assert memory.find_held(tmp_path, HOLDER) == {}


def test_a_ward_directory_that_is_a_link_is_never_written_through(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    partner_copy.partner_dir(tmp_path).mkdir()
    os.symlink(tmp_path / "elsewhere", partner_copy.partner_dir(tmp_path) / "rank-1")
    record, data = copy_of(5)
    with pytest.raises(NotADirectoryError):
        holder_store(tmp_path).receive(record, memoryview(data.numpy()))
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_partner_path_that_is_a_file_refuses_the_copy_over_the_link(tmp_path, tracebacks):
    partner_copy.partner_dir(tmp_path).write_text("in the way")
    holder = partner_link.PartnerLink(holder_store(tmp_path), "127.0.0.1", 1 << 20)
    try:
        holder.start(KEY, None)
        record, data = copy_of(5)
        send_each(holder.endpoint, [[of_record(record), data.numpy().tobytes()]])
        wait_for(lambda: holder.stats().refused == 1, what=holder.stats)
        assert holder.stats().last_refusal.startswith("could not be held (")
    finally:
        holder.close()
    assert not tracebacks


def test_a_held_record_nested_too_deep_to_read_is_refused_not_raised(tmp_path):
    """A record a sender nested just under the depth the receiver reads (or one written in
    place) is read again, from deeper down, at a resume: refused there, no RecursionError."""
    held_copy(tmp_path)
    json_path = partner_copy.partner_dir(tmp_path) / "rank-1" / "slot-0.json"
    record = json.loads(json_path.read_text())
    deep = "[" * 5000 + "]" * 5000
    json_path.write_text(json.dumps(record)[:-1] + f',"meta":{deep}}}')
    assert memory.find_held(tmp_path, HOLDER) == {}
    directory, ward = partner_copy.partner_dir(tmp_path), partner_copy.ward_expect(HOLDER, 1)
    why = partner_copy.find_ward(directory, ward, 2)[1][0]
    assert why.startswith("slot 0: unreadable (") and len(why) < 300, why


# --- where a link listens, how much a node holds ---------------------------------------------
def test_a_loopback_name_across_hosts_binds_toward_the_rendezvous_or_not_at_all(monkeypatch):
    monkeypatch.setattr(partner_link.socket, "gethostbyname", lambda _: "127.0.1.1")
    assert partner_link.bind_host(["a", "b"], None) is None
    assert partner_link.bind_host(["a", "b"], "127.0.0.1") is None  # no route off this host
    monkeypatch.setattr(partner_link.socket, "gethostbyname", lambda _: "10.1.2.3")
    assert partner_link.bind_host(["a", "b"], None) == "10.1.2.3"

    def unresolved(_):
        raise OSError("no name")

    monkeypatch.setattr(partner_link.socket, "gethostbyname", unresolved)
    assert partner_link.bind_host(["a", "b"], None) is None
    assert partner_link.bind_host(["a", "a"], None) == "127.0.0.1"


@pytest.mark.parametrize(
    ("nodes", "node", "held"),
    [
        (["a", "a", "b", "b"], "a", 2),
        (["a", "a", "a", "b"], "b", 3),  # a small node after a big one holds them all
        (["a", "a", "a", "b"], "a", 1),
        (["a", "a"], "a", 0),  # one node: none
    ],
)
def test_what_a_node_holds_for_others_counts_uneven_nodes(nodes, node, held):
    assert partners.held_on(nodes, node) == held
