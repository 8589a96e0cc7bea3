"""Fork templates ([restart] template): whether a job keeps them, the commands that start them
and the ranks forked from them, and the socket contract's framing (no process)."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from contracts import template_msgs
from supervisor.launch.resolve import Resolved
from supervisor.policy.prepared_rules import template_unavailable
from supervisor.run.context import JobContext
from supervisor.run.templates import MAX_LOST_IN_A_ROW, STEADY_S, Templates, lost_in_a_row
from supervisor.settings import loading


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({}, None),
        ({"wanted": False}, "restart.template is false"),
        ({"launcher_cannot": "prepared ranks need MPICH Hydra's mpiexec, not pals"},
         "fork templates need MPICH Hydra's mpiexec, not pals"),
        ({"module": "my.trainer"}, "worker module my.trainer has no fork template"),
    ],
)  # fmt: skip
def test_a_job_keeps_templates_only_where_they_can_serve(change, why):
    facts = {"wanted": True, "launcher_cannot": None, "module": "worker.train", **change}
    got = template_unavailable(**facts)
    assert got == why if why is None else got.startswith(why)


def resolved(tmp_path, restart=None, launcher="mpiexec", flavor="hydra") -> Resolved:
    launch = {"launcher": launcher, "nodes": ["a", "b"], "ranks_per_node": 2}
    cfg = loading.from_dict(
        {"launch": launch, "worker": {"model": "debug"}, "restart": restart or {}}
    )
    return Resolved(cfg, tmp_path, ["a", "b"], "/usr/bin/mpiexec", flavor)


def test_every_rank_is_started_through_the_client_and_each_node_gets_one_template(tmp_path):
    job = resolved(tmp_path)
    argv = job.plan({}).procs[0].argv
    at = argv.index("-m") + 1
    assert argv[at : at + 3] == ["worker.template_client", "worker.train", "--model"]
    template = job.template_plan({}, "b").procs[0].argv
    assert template[template.index("-n") + 1] == "1"
    assert template[template.index("-hosts") + 1] == "b" and "-f" not in template
    assert template[template.index("-m") + 1] == "worker.template"


def test_without_templates_a_rank_is_a_new_interpreter(tmp_path):
    for job in (resolved(tmp_path, {"template": False}), resolved(tmp_path, flavor="pals")):
        assert job.template_off is not None
        argv = job.plan({}).procs[0].argv
        assert "worker.template_client" not in argv
        assert argv[argv.index("-m") + 1] == "worker.train"


def test_the_socket_is_per_user_job_and_node():
    env = {"ES_JOB_ID": "j-1", "PMI_HOSTNAME": "n3"}
    name = template_msgs.socket_name(env, "host")
    assert name.startswith("\0es-template-") and name.endswith("-j-1-n3")
    assert template_msgs.socket_name({"ES_JOB_ID": "j-1"}, "host").endswith("-j-1-host")


def test_a_rank_is_forked_only_with_the_start_time_environment_of_its_template():
    own = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "PATH": "/bin", "ES_ATTEMPT": "0"}
    same = {**own, "PATH": "/usr/bin", "ES_ATTEMPT": "3", "OMP_NUM_THREADS": "1"}
    assert template_msgs.start_env_differs(own, same) is None  # read later: the rank's own
    why = template_msgs.start_env_differs(own, {"PATH": "/bin"})
    assert why.startswith("GLIBC_TUNABLES is None for the rank, 'glibc.malloc.hugetlb=1' for")
    assert "MALLOC_ARENA_MAX" in template_msgs.start_env_differs({}, {"MALLOC_ARENA_MAX": "2"})
    assert "LD_PRELOAD" in template_msgs.start_env_differs({"LD_PRELOAD": "x.so"}, {})


@pytest.mark.parametrize("huge_pages", [True, False])
@pytest.mark.parametrize("yours", [None, "glibc.malloc.arena_max=2"])
@pytest.mark.parametrize("in_launch_env", [False, True])
def test_a_template_starts_with_what_its_ranks_read_at_their_start(
    tmp_path, monkeypatch, huge_pages, yours, in_launch_env
):
    launch: dict = {"huge_pages": huge_pages}
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    if yours and in_launch_env:
        launch["env"] = {"GLIBC_TUNABLES": yours}
    elif yours:
        monkeypatch.setenv("GLIBC_TUNABLES", yours)
    cfg = loading.from_dict({"job": {"name": "t", "run_dir": str(tmp_path)}, "launch": launch})
    job = JobContext(
        Resolved(cfg, tmp_path, [socket.gethostname()], "python", "mpiexec"), "job", "00" * 32,
        "tcp://127.0.0.1:1", None, None, print, lambda: None, None,
    )  # fmt: skip
    template = {**os.environ, **Templates(job).env()}  # as the launch gives each its environment
    for standby in (False, True):
        rank = {**os.environ, **job.rank_env(3, tmp_path, standby)}
        assert template_msgs.start_env_differs(template, rank) is None
    assert ("hugetlb=1" in template.get("GLIBC_TUNABLES", "")) == huge_pages


def test_messages_round_trip_with_descriptors_and_bad_ones_are_refused():
    a, b = socket.socketpair()
    with a, b:
        r, w = __import__("os").pipe()
        template_msgs.send(a, {"module": "worker.train", "fds": [w]}, [w])
        message, fds = template_msgs.receive(b, with_fds=True)
        assert message == {"module": "worker.train", "fds": [w]} and len(fds) == 1
        a.sendall(b"\x00\x00\x00\x05[1,2]")
        with pytest.raises(template_msgs.TemplateError, match="not a JSON object"):
            template_msgs.receive(b)
        a.sendall(b"\xff\xff\xff\xff")
        with pytest.raises(template_msgs.TemplateError, match="a message of"):
            template_msgs.receive(b)
        a.sendall(b'\x00\x00\x00\x03{"')
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(template_msgs.TemplateError, match="ended inside"):
            template_msgs.receive(b)


def test_a_request_read_in_pieces_is_whole_only_at_its_end():
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        r, w = os.pipe()
        data = template_msgs.frame({"module": "worker.train", "fds": [w]})
        reader = template_msgs.Assembler()
        with pytest.raises(BlockingIOError):  # nothing yet: the template serves others meanwhile
            reader.read(b)
        a.sendmsg([data[:2]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", w))])
        assert reader.read(b) is None and len(reader.fds) == 1
        a.sendall(data[2:-1])
        assert reader.read(b) is None
        a.sendall(data[-1:])
        assert reader.read(b) == {"module": "worker.train", "fds": [w]}
        for fd in (r, w, *reader.fds):
            os.close(fd)
        a.sendall(data + b"x")
        with pytest.raises(template_msgs.TemplateError, match="more than one message"):
            template_msgs.Assembler().read(b)
        a.sendall(data[:5])
        a.shutdown(socket.SHUT_WR)
        reader = template_msgs.Assembler()
        with pytest.raises(template_msgs.TemplateError, match="ended inside"):
            while reader.read(b) is None:
                pass


def test_only_templates_lost_one_soon_after_another_make_a_row():
    lost = 0
    for _ in range(MAX_LOST_IN_A_ROW):
        lost = lost_in_a_row(lost, ran_s=2.0)  # each ended while it started: a row
    assert lost == MAX_LOST_IN_A_ROW  # the node's ranks start cold from now on
    assert lost_in_a_row(MAX_LOST_IN_A_ROW - 1, ran_s=STEADY_S) == 1  # it ran: a new count
