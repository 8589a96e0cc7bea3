"""The message contract: signing, schema, and the reason each bad message is dropped for."""

from __future__ import annotations

import json

import pytest

from contracts import messages

KEY = b"k" * 32
ID = messages.RankIdentity(job="j", attempt=0, rank=1, world=2, host="h", pid=42)


def frames(kind="step", key=KEY, **fields):
    fields = fields or {"step": 3, "loss": 1.5, "dt": 0.1}
    return messages.encode(key, ID.message(kind, 1.0, **fields))


def test_round_trip():
    msg = messages.decode(KEY, frames(), job="j")
    assert msg["kind"] == "step" and msg["step"] == 3 and msg["rank"] == 1


def body_frames(body: bytes):
    return messages.sign(KEY, body) + body


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda: frames()[:64], "frames"),
        (lambda: frames(key=b"other"), "signature"),
        (lambda: b"0" * 64 + frames()[64:], "signature"),
        (lambda: frames()[64:], "signature"),
        (lambda: body_frames(b"{not json"), "json"),
        (lambda: body_frames(b"[1, 2]"), "json"),
        (lambda: body_frames(json.dumps({"v": 1}).encode()), "schema"),
        (lambda: frames(kind="nope", step=1), "schema"),
        (lambda: frames(kind="ckpt", step=1, state="half"), "schema"),
        (lambda: frames(kind="step", step=True, loss=1.0, dt=0.1), "schema"),
        (lambda: body_frames(b"x" * (messages.MAX_MESSAGE_BYTES + 1)), "oversized"),
    ],
)
def test_bad_messages_have_a_reason(make, reason):
    with pytest.raises(messages.BadMessage) as err:
        messages.decode(KEY, make(), job="j")
    assert err.value.reason == reason


def test_other_job_and_version():
    with pytest.raises(messages.BadMessage) as err:
        messages.decode(KEY, frames(), job="another")
    assert err.value.reason == "other_job"
    msg = ID.message("beat", 1.0, phase="train", step=1)
    msg["v"] = 99
    with pytest.raises(messages.BadMessage) as err:
        messages.decode(KEY, messages.encode(KEY, msg))
    assert err.value.reason == "version"


def test_resumed_may_say_where_from():
    plain = {"step": 10, "restart_seconds": 1.5}
    assert "source" not in messages.decode(KEY, frames("resumed", **plain), job="j")  # as before
    for source in ("memory", "durable"):
        msg = messages.decode(KEY, frames("resumed", **plain, source=source), job="j")
        assert msg["source"] == source
    for bad in ("disk", "", 1, None, True, ["memory"], {"memory": 1}):
        with pytest.raises(messages.BadMessage) as err:
            messages.decode(KEY, frames("resumed", **plain, source=bad), job="j")
        assert err.value.reason == "schema"
    messages.validate(
        ID.message("step", 1.0, step=1, loss=1.0, dt=0.1, source="x")
    )  # not its field


def test_an_error_may_say_its_cause():
    """Issue 40: the guard's give-up says so (`cause` diverged), so the supervisor does not
    relaunch it; an error without a cause is as before; any other cause is malformed."""
    assert "cause" not in messages.decode(KEY, frames("error", message="boom"), job="j")
    msg = messages.decode(KEY, frames("error", message="gave up", cause="diverged"), job="j")
    assert msg["cause"] == "diverged"
    msg = messages.decode(KEY, frames("error", message="other model", cause="usage"), job="j")
    assert msg["cause"] == "usage"  # a refused input (exit 2)
    for bad in ("tired", "", 1, None, True, ["diverged"], {"diverged": 1}):
        with pytest.raises(messages.BadMessage) as err:
            messages.decode(KEY, frames("error", message="x", cause=bad), job="j")
        assert err.value.reason == "schema"


def test_a_standby_may_say_the_cpu_its_preparation_took():
    """A standby's phase message carries `cpu_s` (its process's CPU seconds): a number of
    seconds >= 0, or the message is malformed."""
    phase = {"phase": "standby", "step": 0, "prepared": "imports"}
    assert "cpu_s" not in messages.decode(KEY, frames("phase", **phase), job="j")  # as before
    msg = messages.decode(KEY, frames("phase", **phase, cpu_s=0.42), job="j")
    assert msg["cpu_s"] == 0.42
    for bad in (-1, "0.4", None, True, [0.4], 1e9):
        with pytest.raises(messages.BadMessage) as err:
            messages.decode(KEY, frames("phase", **phase, cpu_s=bad), job="j")
        assert err.value.reason == "schema"
