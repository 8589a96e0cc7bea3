"""Fencing's parts alone: the rank's lease (a real process that runs out of it ends itself), the
fence records and what they refuse, the lease renewals on a real control channel, and the
`partition` fault's config checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from contracts import ckpt_files, fences
from contracts.config_table import ConfigError
from faults import partition_problem
from faults.spec import JobShape, parse
from worker.lease import Lease, fenced_line

REPO = Path(__file__).resolve().parents[2]


def test_a_lease_only_grows_and_runs_out_by_the_wall_clock():
    lease = Lease()
    assert lease.left_s() is None  # no lease: never fenced
    lease.enforce()
    lease.start(5.0)
    until = lease.until
    lease.renew(until - 1, 7)  # stale: a renewal queued through a cut
    assert lease.until == until and lease.epoch == 0
    lease.renew(until + 3, 8)
    assert lease.until == until + 3 and lease.epoch == 8
    assert 7 < lease.left_s() <= 8


def test_a_rank_whose_renewals_come_run_out_says_its_clock_may_be_ahead():
    """A rank whose clock is ahead of its supervisor's by more than the lease hears every
    renewal and is fenced all the same: it said "unreachable or gone", which it was not."""
    lease = Lease()
    lease.start(5.0)
    until = lease.until
    lease.renew(time.time() - 3, 4)  # as heard 3 s past its until
    assert lease.until == until and lease.expired is not None and lease.expired[1] == 4
    assert "this host's clock is ahead of the supervisor's" in fenced_line(
        0.1, lease.epoch, lease.expired
    )
    lease.renew(until + 1, 6)  # a renewal that counted came after it
    assert "unreachable or gone" in fenced_line(0.1, lease.epoch, lease.expired)


def test_a_rank_whose_lease_runs_out_kills_itself_at_its_next_write():
    code = (
        "import os, time\n"
        "os.environ['ES_LEASE_S'] = '0.3'\n"
        "from worker import lease\n"
        "lease.start_from_env()\n"
        "lease.guard(); print('wrote', flush=True)\n"
        "time.sleep(0.5)\n"
        "lease.guard(); print('wrote after', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out
    assert out.stdout.splitlines() == ["wrote"]
    assert "fenced: the supervisor's lease ran out" in out.stderr


def _meta(attempt: int, saved_at: float) -> tuple[dict, float]:
    return {"job": "j", "attempt": attempt, "lease_epoch": 3}, saved_at


def test_what_a_fenced_attempt_wrote_after_its_fence_is_refused(tmp_path):
    assert fences.read_all(tmp_path) == {}  # no fences dir
    fences.write(tmp_path, fences.Fence("j", 4, 1000.0, "hang"))
    (tmp_path / fences.DIR / "junk.json").write_text("[1, 2]")  # not a record: ignored
    (tmp_path / fences.DIR / "big.json").write_bytes(b"x" * (fences.MAX_RECORD_BYTES + 1))
    found = fences.read_all(tmp_path)
    assert list(found) == [("j", 4)]
    assert fences.late(*_meta(4, 999.0), found) is None  # before its fence: good
    assert "after the supervisor fenced it (hang)" in fences.late(*_meta(4, 1001.0), found)
    assert fences.late({"job": "j", "attempt": 4}, None, found) is not None  # no time: refused
    assert fences.late(*_meta(5, 2000.0), found) is None  # another attempt
    assert fences.late(None, 2000.0, found) is None  # written without a supervisor
    assert fences.late({"job": "other", "attempt": 4}, 2000.0, found) is None


def test_a_checkpoint_names_its_writer():
    env = {"ES_JOB_ID": "j", "ES_ATTEMPT": "6"}
    assert ckpt_files.writer_of(env, 9) == {"job": "j", "attempt": 6, "lease_epoch": 9}
    assert ckpt_files.writer_of({}, 9) == {}


def test_the_supervisor_renews_only_the_attempts_it_keeps():
    zmq = pytest.importorskip("zmq")
    from contracts import control_msgs, messages
    from supervisor.watch.control import ControlServer

    key, job = b"k" * 32, "job-1"
    server = ControlServer(key, job, "127.0.0.1", "127.0.0.1")
    ctx = zmq.Context()
    socks = []
    try:
        from worker.control_channel import ControlChannel

        for attempt in (1, 2):
            ident = messages.RankIdentity(job=job, attempt=attempt, rank=0, world=1, host="h",
                                          pid=1)  # fmt: skip
            channel = ControlChannel(server.address, key, ident)
            socks.append((attempt, channel.open(ctx, zmq)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(server.owner(a, 0) for a in (1, 2)):
            time.sleep(0.02)
        server.fence(2)
        assert server.renew(time.time() + 10, time.time()) == 1
        got = {}
        for attempt, sock in socks:
            if sock.poll(2000 if attempt == 1 else 300):
                got[attempt] = control_msgs.decode_control(key, sock.recv(), job, attempt, 0)
        assert list(got) == [1] and got[1]["action"] == "lease" and got[1]["epoch"] == 1
        server.forget(1)
        assert server.renew(time.time() + 10, time.time()) == 0
    finally:
        for _, sock in socks:
            sock.close(linger=0)
        ctx.term()
        server.close()


def test_a_partition_is_declared_on_a_node_and_needs_the_test_bed():
    shape = JobShape(world=4, nodes=4)
    spec = parse({"at_step": 5, "action": "partition", "target": "node:1", "duration_s": 30}, 0,
                 "job.toml", shape)  # fmt: skip
    assert spec.action.kind == "partition" and spec.action.duration_s == 30
    assert parse({"at_step": 5, "action": "partition", "target": "rank:2"}, 0, "job.toml",
                 shape).action.duration_s == 0  # fmt: skip
    for bad in ({"target": "all"}, {"target": "node:1", "duration_s": -1},
                {"target": "node:1", "signal": 9}):  # fmt: skip
        with pytest.raises(ConfigError):
            parse({"at_step": 5, "action": "partition", **bad}, 0, "job.toml", shape)
    assert "emulated nodes" in partition_problem(["n0", "n1"], emulated=True)
    assert "not a test-bed host: nowhere-9" in partition_problem(["nowhere-9"], emulated=False)


def _record(tmp_path: Path, name: str, data: bytes | dict) -> None:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    (tmp_path / fences.DIR / name).write_bytes(raw)


def test_what_is_no_fence_record_is_ignored_and_never_hangs_a_reader(tmp_path):
    """A FIFO or a link to a device named like a record used to block a reader (the supervisor
    at an attempt's end, rank 0 at a resume); JSON nested deep raised RecursionError."""
    (tmp_path / fences.DIR).mkdir()
    good = {"job": "j", "attempt": 1, "at": 1000.0, "why": "hang"}
    os.mkfifo(tmp_path / fences.DIR / "j-2.json")
    os.symlink("/dev/zero", tmp_path / fences.DIR / "j-3.json")
    _record(tmp_path, "j-4.json", b"[" * 2000 + b"]" * 2000)
    _record(tmp_path, "j-5.json", b'{"job": "j", "attempt": 5, "at": NaN, "why": "x"}')
    _record(tmp_path, "j-6.json", {**good, "attempt": "6"})
    _record(tmp_path, "j-7.json", {**good, "attempt": 1})  # a copy under another name
    _record(tmp_path, "j-8.json", {**good, "attempt": True})
    _record(tmp_path, "j-10.json", {**good, "attempt": 10, "at": 10**400})
    _record(tmp_path, "j-1.json", good)
    (tmp_path / fences.DIR / "j-9.json").mkdir()
    assert list(fences.read_all(tmp_path)) == [("j", 1)]
    assert fences.record({**good, "job": ["j"]}, "j-1.json") is None
    fences.write(tmp_path, fences.Fence("j", 6, 2000.0, "hang"))  # junk there: replaced
    assert fences.read_all(tmp_path)[("j", 6)].at == 2000.0
    (tmp_path / fences.DIR).rename(tmp_path / "gone")
    (tmp_path / fences.DIR).write_text("a file")
    assert fences.read_all(tmp_path) == {}
    with pytest.raises(OSError):  # the supervisor says `fence_unwritten`
        fences.write(tmp_path, fences.Fence("j", 1, 1000.0, "hang"))


def test_a_malformed_writer_or_time_neither_crashes_nor_loses_a_good_checkpoint(tmp_path):
    """An unhashable `writer` field crashed `late` (and with it the supervisor's sweep and rank
    0's resume); a checkpoint of no known `saved_at` was removed though it may be a good one."""
    fences.write(tmp_path, fences.Fence("j", 1, 1000.0, "hang"))
    fenced = fences.read_all(tmp_path)
    for writer in ({"job": ["j"], "attempt": 1}, {"job": "j", "attempt": [1]}, [1], "j-1",
                   {"job": "j", "attempt": True}):  # fmt: skip
        assert fences.late(writer, 2000.0, fenced) is None  # names no attempt
    for saved_at in (None, "2000", float("nan"), True, float("inf"), 10**400):
        assert "at no time it says" in fences.late({"job": "j", "attempt": 1}, saved_at, fenced)
        assert not fences.removable({"job": "j", "attempt": 1}, saved_at, fenced)
    metas = {
        1: {"saved_at": 999.0},  # before its fence
        2: {"saved_at": 1001.0},  # after: the one to remove
        3: {},  # no time: refused, kept
        4: {"saved_at": 5000.0, "writer": {"job": ["j"], "attempt": 1}},
        5: [1, 2],
        6: "[" * 2000 + "]" * 2000,
    }
    for step, meta in metas.items():
        d = ckpt_files.step_dir(tmp_path, step)
        d.mkdir()
        if isinstance(meta, dict):
            meta = json.dumps({"writer": {"job": "j", "attempt": 1}, "files": {}, **meta})
        (d / ckpt_files.META).write_text(meta if isinstance(meta, str) else json.dumps(meta))
        (d / ckpt_files.MARKER).write_text("")
    assert fences.sweep(tmp_path) == [2]
    assert [f.step for f in ckpt_files.scan(tmp_path)] == [1, 3, 4, 5, 6]


def test_a_resume_skips_what_it_cannot_read_or_remove(tmp_path, one_rank_group, monkeypatch):
    """A `meta.json` that is a list or nested deep crashed rank 0's resume; so did a late
    checkpoint in a read-only dir (its removal raised)."""
    from worker.ckpt import resume

    fences.write(tmp_path, fences.Fence("j", 1, 1000.0, "hang"))
    for step, meta in {1: json.dumps({"files": {}}), 2: "[1]", 3: "[" * 2000 + "]" * 2000,
                       4: json.dumps({"files": [], "rng": []}),
                       5: json.dumps({"files": {}, "writer": {"job": "j", "attempt": 1},
                                      "saved_at": 2000.0})}.items():  # fmt: skip
        d = ckpt_files.step_dir(tmp_path, step)
        d.mkdir()
        (d / ckpt_files.META).write_text(meta)
        (d / ckpt_files.MARKER).write_text("")

    def read_only(directory: Path) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(ckpt_files, "remove_step_dir", read_only)
    said: list[str] = []
    chosen = resume.choose_checkpoint(tmp_path, rank=0, verify="crc", log=said.append,
                                      fenced=fences.read_all(tmp_path))  # fmt: skip
    assert chosen == ckpt_files.step_dir(tmp_path, 1)
    assert "skipping checkpoint step-5 (it cannot be removed: Read-only file system)" in said[0]
    assert [s.split(":")[1].split()[-1] for s in said[1:]] == ["step-4", "step-3", "step-2"]


def test_a_supervisor_stopped_longer_than_a_lease_says_its_ranks_lapsed():
    """A supervisor SIGSTOPped 15 s (lease 10 s) found its ranks gone and said only `hang: no
    heartbeat for 15.1 s`: their leases had run out, none hung. Now `leases_lapsed` says so."""
    import asyncio

    from supervisor.run import services
    from supervisor.settings.config import HeartbeatConfig

    class Control:
        rounds = 0
        last_refused = None

        def drain(self) -> None:
            if self.rounds == 2:
                time.sleep(0.8)  # the supervisor stopped, past the lease

        def renew(self, until: float, t: float) -> int:
            self.rounds += 1
            return 2

        def refusals(self) -> dict[str, int]:
            return {}

    events: list[tuple[str, dict]] = []

    async def serve() -> None:
        heartbeat = HeartbeatConfig(interval_s=0.02, check_s=0.01, lease_s=0.5)
        task = asyncio.create_task(services.serve_control(
            Control(), heartbeat, lambda e, **kw: events.append((e, kw))))  # fmt: skip
        await asyncio.sleep(1.2)
        task.cancel()

    asyncio.run(serve())
    assert {e for e, _ in events} == {"leases_lapsed"}
    assert [kw["lease_s"] for _, kw in events if kw["gap_s"] >= 0.8] == [0.5]


def test_a_continued_job_numbers_its_attempts_past_its_fenced_ones(tmp_path):
    """A job continued in a run dir whose attempts/ was removed numbered its attempts from 0
    again: its attempt 0 saved after the old attempt 0's fence, and its good checkpoints were
    removed (`fenced_writes_removed`) at its end. Its first attempt now comes after them."""
    for attempt in (0, 1, 4):
        fences.write(tmp_path, fences.Fence("job-a", attempt, 1000.0, "hang"))
    fences.write(tmp_path, fences.Fence("job-b", 9, 1000.0, "hang"))
    fenced = fences.read_all(tmp_path)
    assert fences.after(fenced, "job-a") == 5
    assert fences.after(fenced, "job-c") == 0
    assert fences.after({}, "job-a") == 0


def test_status_shows_no_checkpoint_a_resume_refuses(tmp_path, capsys):
    """`status` named a cut-off rank's late checkpoint (step 100001) as the newest, which every
    resume refuses and the next sweep removes."""
    from supervisor.commands import cli
    from tests.support import make_run

    run = make_run(tmp_path, finished=False)
    fences.write(run / "ckpt", fences.Fence("j", 3, 1000.0, "hang"))
    late = ckpt_files.step_dir(run / "ckpt", 100_001)
    late.mkdir()
    ckpt_files.mark_complete(late, {"writer": {"job": "j", "attempt": 3}, "saved_at": 1001.0})
    cli.main(["status", str(run)])
    out = capsys.readouterr().out
    assert "checkpoint: step 20" in out and "100001" not in out
