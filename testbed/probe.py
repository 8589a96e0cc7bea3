"""Whether this machine can hold a bed at all (root, the tools, namespaces, bridges and veth
pairs), asked without touching the machine's own network: the tests skip with the answer."""

from __future__ import annotations

import os
import shutil

import testbed.network as network
from testbed.commands import BedError, run

TOOLS = ("ip", "nsenter", "unshare", "mount", "sh")
# In a throwaway network namespace: the bed's own kinds of link can be made here.
TRY_NAMESPACES = ["unshare", "--net", "--pid", "--fork", "--mount", "--uts", "--ipc",
                  "--propagation", "private", "--", "sh", "-c",
                  "ip link add estb-probe type bridge && "
                  "ip link add estb-probe-a type veth peer name estb-probe-b"]  # fmt: skip


def available() -> str | None:
    """None when a bed can be brought up here, else one line saying why not."""
    if os.geteuid() != 0:
        return "the test bed needs root (it makes namespaces, links and mounts)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"the test bed needs the commands {', '.join(missing)}"
    try:
        run(TRY_NAMESPACES, timeout=10)
        foreign = network.foreign_users_of_subnet()
    except BedError as e:
        return f"namespaces do not work here: {e}"
    if foreign:
        return f"the test bed's range 10.233.0.0/24 is in use here: {', '.join(foreign)}"
    return None
