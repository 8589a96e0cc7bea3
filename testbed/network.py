"""The bed's network: a bridge on the machine (the head node's address on it) and, per host, a
network namespace joined to the bridge by a veth pair. No default route in the hosts and no
forwarding on the machine: a host reaches only its own loopback, the other hosts and the head."""

from __future__ import annotations

import json
import os
from pathlib import Path

from testbed.commands import run
from testbed.layout import BRIDGE, HEAD_ADDRESS, NETNS_PREFIX, PREFIX, SUBNET, HostPlan

NETNS_DIR = Path("/run/netns")


def links() -> list[dict]:
    """The machine's links with their addresses (`ip -j addr`)."""
    return json.loads(run(["ip", "-j", "addr", "show"]) or "[]")


def foreign_users_of_subnet() -> list[str]:
    """Links other than the bed's that hold an address in its range (the bed would clash)."""
    return [
        f"{link['ifname']} ({a['local']})"
        for link in links()
        if not link["ifname"].startswith(BRIDGE)
        for a in link.get("addr_info", [])
        if a.get("local", "").startswith(f"{SUBNET}.")
    ]


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def bed_links() -> list[str]:
    """The bed's links in the machine's namespace: the bridge and the bridge's veth ends."""
    return sorted(n for n in os.listdir("/sys/class/net") if n.startswith(BRIDGE))


def bed_netns() -> list[str]:
    """The network namespaces named by the bed."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(NETNS_PREFIX))


def netns_inode(netns: str) -> int | None:
    try:
        return (NETNS_DIR / netns).stat().st_ino
    except FileNotFoundError:
        return None


def add_bridge() -> None:
    run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "addr", "add", f"{HEAD_ADDRESS}/{PREFIX}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])


def add_host(host: HostPlan) -> None:
    """The host's namespace with `lo` and `eth0` (its address), joined to the bridge."""
    ns = ["ip", "-n", host.netns]
    run(["ip", "netns", "add", host.netns])
    run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
         "netns", host.netns])  # fmt: skip
    run(["ip", "link", "set", host.veth, "master", BRIDGE])
    run([*ns, "addr", "add", f"{host.address}/{PREFIX}", "dev", "eth0"])
    run([*ns, "link", "set", "lo", "up"])
    run([*ns, "link", "set", "eth0", "up"])
    set_link(host, up=True)


def set_link(host: HostPlan, up: bool) -> None:
    """The host's cable: down, it neither sends nor receives (its own end stays configured)."""
    run(["ip", "link", "set", host.veth, "up" if up else "down"])


def link_is_up(host: HostPlan) -> bool:
    try:
        return Path(f"/sys/class/net/{host.veth}/operstate").read_text().strip() == "up"
    except FileNotFoundError:
        return False


def remove_all() -> None:
    """Every bed namespace and link there is (a namespace's removal takes its veth pair)."""
    for ns in bed_netns():
        run(["ip", "netns", "del", ns], check=False)
    for name in reversed(bed_links()):  # the veth ends, then the bridge
        run(["ip", "link", "del", name], check=False)
