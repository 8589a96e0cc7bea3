"""The job's services that outlive its attempts: where the heartbeat server binds, how often the
messages it drops are reported, and the control channel's intake of hellos and its refusals."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from supervisor.launch import hosts
from supervisor.launch.resolve import Resolved
from supervisor.settings.config import HeartbeatConfig
from supervisor.watch.control import ControlServer
from supervisor.watch.heartbeat import HeartbeatServer, node_addresses

BAD_MESSAGES_EVERY_S = 5.0


def bind_heartbeat(resolved: Resolved, key: str, job_id: str) -> HeartbeatServer:
    """The heartbeat server: on loopback when every node is this host (or emulated), else on
    every address, open only to the job's nodes."""
    cfg = resolved.cfg
    heartbeat = cfg.heartbeat
    local = cfg.launch.emulate_nodes or all(hosts.is_this_host(n) for n in resolved.nodes)
    bind = heartbeat.bind if heartbeat.bind != "auto" else ("127.0.0.1" if local else "0.0.0.0")
    advertise = (
        heartbeat.advertise
        if heartbeat.advertise != "auto"
        else ("127.0.0.1" if local else hosts.this_host())
    )
    # Bound beyond loopback (a multi-node job): only the job's nodes may even connect.
    allow = () if bind.startswith("127.") else node_addresses(resolved.nodes)
    return HeartbeatServer(key.encode(), job_id, bind, heartbeat.port, advertise, allow)


async def report_dropped(
    server: HeartbeatServer, heartbeat: HeartbeatConfig, emit: Callable[..., None]
) -> None:
    """A `bad_messages` event when the count of dropped (unsigned, malformed) messages moves,
    at most one every BAD_MESSAGES_EVERY_S: a flood must not flood the log too."""
    reported, last = 0, -BAD_MESSAGES_EVERY_S
    while True:
        await asyncio.sleep(heartbeat.check_s)
        dropped = sum(server.dropped.values())
        now = asyncio.get_running_loop().time()
        if dropped != reported and now - last >= BAD_MESSAGES_EVERY_S:
            emit(
                "bad_messages",
                total=dropped,
                new=dropped - reported,
                by_reason=dict(server.dropped),
            )
            reported, last = dropped, now


async def serve_control(
    control: ControlServer, heartbeat: HeartbeatConfig, emit: Callable[..., None]
) -> None:
    """Take the ranks' hellos as they come (a rank owns its identity before its first command is
    due), renew the leases of the ranks the job keeps every beat interval, and say each refused
    claim of the control channel: a `control_refused` event when the
    count moves, at most one every BAD_MESSAGES_EVERY_S (a flood must not flood the log). A
    round that comes more than a lease after the last (the supervisor was stopped, or starved)
    is said first (`leases_lapsed`): the ranks have ended themselves, none hung."""
    reported, last = 0, -BAD_MESSAGES_EVERY_S
    lease_s, renewed = heartbeat.lease_seconds(), -float("inf")
    while True:
        await asyncio.sleep(heartbeat.check_s)
        control.drain()
        now = asyncio.get_running_loop().time()
        if lease_s > 0 and now - renewed >= heartbeat.interval_s:  # the ranks' leases
            if renewed > -float("inf") and now - renewed > lease_s:
                emit("leases_lapsed", gap_s=round(now - renewed, 3), lease_s=lease_s)
            t = time.time()
            control.renew(t + lease_s, t)
            renewed = now
        by_reason = control.refusals()
        total = sum(by_reason.values())
        now = asyncio.get_running_loop().time()
        if total != reported and now - last >= BAD_MESSAGES_EVERY_S:
            newest = {"last": control.last_refused} if control.last_refused else {}
            emit(
                "control_refused",
                total=total,
                new=total - reported,
                by_reason=dict(by_reason),
                **newest,
            )
            reported, last = total, now
