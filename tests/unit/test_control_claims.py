"""Who owns a rank's identity on the control channel (supervisor.policy.control_claims), and the
hello and keys it is claimed with (contracts.control_msgs). The real sockets and a keyless
intruder: tests/e2e/test_control_channel.py."""

from __future__ import annotations

import pytest

from contracts import control_msgs, messages
from supervisor.policy.control_claims import CLAIMED, CONN, ENDED, Claim, Verdict, judge

KEY = b"k" * 64
A = control_msgs.control_conn(3, 1, "a" * 16)
B = control_msgs.control_conn(3, 1, "b" * 16)


def claim(sender: bytes, conn: bytes | None = None, attempt: int = 3, rank: int = 1) -> Claim:
    return Claim(attempt, rank, (conn or sender).decode(), sender)


def test_the_first_claimant_owns_the_identity_and_keeps_it():
    assert judge(claim(A), None, ended=False) == Verdict(A, None)
    assert judge(claim(A), A, ended=False) == Verdict(A, None)  # its hello again: no change
    # A second claimant is refused whatever it says, and the owner stays.
    assert judge(claim(B), A, ended=False) == Verdict(A, CLAIMED)


def test_a_hello_binds_only_the_routing_id_that_carries_it():
    """A hello carried by another connection than the one it names (one replayed or relayed), or
    a routing id not of the identity it claims, binds nothing."""
    assert judge(claim(B, conn=A), None, ended=False) == Verdict(None, CONN)
    assert judge(claim(A, attempt=4), None, ended=False) == Verdict(None, CONN)
    assert judge(claim(A, rank=0), None, ended=False) == Verdict(None, CONN)
    bare = b"3/1/"
    assert judge(claim(bare), None, ended=False) == Verdict(None, CONN)
    assert judge(claim(b"3/1"), None, ended=False) == Verdict(None, CONN)  # the name alone
    assert judge(claim(b"3/10/" + b"a" * 16, rank=1), None, ended=False).refused == CONN


def test_an_ended_attempt_is_claimed_by_nobody():
    assert judge(claim(A), None, ended=True) == Verdict(None, ENDED)
    assert judge(claim(B, conn=A), None, ended=True).refused == CONN  # the first fault said


def test_the_hello_is_checked_before_any_claim():
    hello = control_msgs.control_hello("job", 3, 1, 1.0, A)
    assert control_msgs.decode_hello(KEY, messages.encode(KEY, hello), "job") == hello
    for frame, reason in (
        (messages.encode(b"x" * 64, hello), "signature"),
        (messages.encode(KEY, {**hello, "job": "other"}), "other_job"),
        (messages.encode(KEY, {**hello, "kind": "control"}), "version"),
        (messages.encode(KEY, {**hello, "rank": "1"}), "schema"),
        (messages.encode(KEY, {**hello, "rank": -1}), "schema"),
        (messages.encode(KEY, {k: v for k, v in hello.items() if k != "conn"}), "schema"),
        (messages.encode(KEY, {**hello, "conn": "x" * 600}), "frames"),
        (b"short", "frames"),
        (messages.sign(KEY, b"[1]") + b"[1]", "json"),
    ):
        with pytest.raises(messages.BadMessage) as err:
            control_msgs.decode_hello(KEY, frame, "job")
        assert err.value.reason == reason, frame


def test_the_curve_keys_come_from_the_jobs_key_alone():
    server = control_msgs.curve_secret(KEY, control_msgs.CURVE_SERVER)
    client = control_msgs.curve_secret(KEY, control_msgs.CURVE_CLIENT)
    assert len(server) == len(client) == 32 and server != client
    assert control_msgs.curve_secret(KEY, control_msgs.CURVE_SERVER) == server
    assert control_msgs.curve_secret(b"j" * 64, control_msgs.CURVE_SERVER) != server


def test_routing_ids_name_the_identity_and_a_nonce():
    assert control_msgs.control_conn(12, 3, "0f" * 8) == b"12/3/" + b"0f" * 8
