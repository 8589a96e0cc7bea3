"""The program the pre-launch node check runs on each node (`python -m
supervisor.host.node_probe DIR...`): can a process start here, and can it write the directories
the ranks will write? It prints one JSON line and exits 0; `node_check.py` judges the lines.
It imports only the standard library and `contracts` (it is to be quick).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence

from contracts import env_names, inject

MARK = "es-node-check "  # the prefix of a report line among the launcher's own output
DOWN_FLAG = "--down"  # the nodes the supervisor knows are down (a node_loss fault took them)


def writable_problem(directory: str) -> str | None:
    """Why the ranks could not write in `directory` (or, not made yet, in the parent it would
    be made in), or None."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return f"{directory}: no existing parent"
        path = parent
    if not os.path.isdir(path):
        return f"{directory}: {path} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".es-node-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{directory}: cannot write in {path} ({exc.strerror or exc})"
    return None


def injected_problems(env: Mapping[str, str], node: str) -> list[str]:
    """Tests and demos: the failure `ES_INJECT`'s `node_check_fail` lays on `node` (the way to
    make one emulated node bad), or why `ES_INJECT` cannot be read."""
    try:
        points = inject.read(env)
    except inject.InjectError as exc:
        return [str(exc)]
    if node in points.node_check_fail:
        return [f"injected failure ({env_names.ENV_INJECT} node_check_fail)"]
    return []


def main(argv: Sequence[str]) -> int:
    """`--dirs DIR... [--down NODE...]`: one report line for this node; none on a node named
    down (an emulated node a `node_loss` took away answers nothing, as a dead node would not)."""
    args, down = list(argv), []
    if DOWN_FLAG in args:
        at = args.index(DOWN_FLAG)
        args, down = args[:at], args[at + 1 :]
    dirs = args[1:] if args[:1] == ["--dirs"] else args
    node = env_names.node_name(os.environ, socket.gethostname())
    if node in down:
        return 0
    problems = [p for d in dirs if (p := writable_problem(d)) is not None]
    problems += injected_problems(os.environ, node)
    print(MARK + json.dumps({"node": node, "problems": problems}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
