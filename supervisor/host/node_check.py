"""A quick check of every node before the job's first launch: can a process start there, and
can it write the directories the ranks will write?

Run through the job's own launcher, one process per node (`python -m supervisor.host.node_check
DIR...`), each printing one JSON line; a node that prints nothing (its process could not start)
or reports a problem is excluded before it costs an attempt. If no node reports at all, the
launcher itself failed: that says nothing about any one node, and the first attempt will show
the real error. On the node it imports only the standard library and the protocol module (it is
to be quick).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contracts import env_names, scratch

if TYPE_CHECKING:
    from supervisor.launch.resolve import Resolved

MARK = "es-node-check "  # the prefix of a report line among the launcher's own output
# Tests and demos: the named nodes fail the check (the way to make one emulated node bad).
ENV_INJECT_FAIL = "ES_INJECT_NODE_CHECK_FAIL"


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


def main(argv: Sequence[str]) -> int:
    """`--dirs DIR...`: one report line for this node."""
    dirs = list(argv[1:]) if argv[:1] == ["--dirs"] else list(argv)
    node = env_names.node_name(os.environ, socket.gethostname())
    problems = [p for d in dirs if (p := writable_problem(d)) is not None]
    if node in os.environ.get(ENV_INJECT_FAIL, "").split(","):
        problems.append(f"injected failure ({ENV_INJECT_FAIL})")
    print(MARK + json.dumps({"node": node, "problems": problems}), flush=True)
    return 0


# --- the supervisor's side ------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckResult:
    failed: dict[str, str]  # node -> why
    reported: int  # nodes that printed a report


def judge(lines: Iterable[str], nodes: Sequence[str]) -> CheckResult:
    """Pure: which of `nodes` failed the check, from the launcher's output lines."""
    found: dict[str, list[str]] = {}
    decoder = json.JSONDecoder()
    for line in lines:
        for body in line.split(MARK)[1:]:  # two ranks' chunks may share a line
            try:  # the object alone: a launcher may add its next prefix after it ("}[2] ")
                report, _ = decoder.raw_decode(body)
                node, problems = report["node"], report["problems"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(node, str) and isinstance(problems, list):
                found[node] = [str(p) for p in problems]
    if not found:
        return CheckResult({}, 0)
    failed = {}
    for node in nodes:
        if node not in found:
            failed[node] = "no report: a process could not be started there"
        elif found[node]:
            failed[node] = "; ".join(found[node])
    return CheckResult(failed, len(found))


def dirs_to_check(flags: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """What the ranks will write on their node: the checkpoint dir, the async stage dir, the
    memory tier's root."""
    from supervisor.host import hygiene

    dirs = [str(flags["ckpt_dir"])] if flags.get("ckpt_dir") else []
    if flags.get("async_ckpt"):
        dirs.append(str(flags.get("ckpt_stage_dir") or hygiene.temp_dir(env)))
    if flags.get("mem_ckpt_interval"):
        dirs.append(scratch.mem_root(dict(env)))
    return dirs


async def run_on(
    r: Resolved, nodes: Sequence[str], dirs: Sequence[str], timeout: float
) -> list[str]:
    """The check's output lines from one process on each of `nodes`, started by the job's own
    launcher (the same command line the ranks get, one per node); what came before a timeout."""
    from supervisor.launch import launcher

    cfg = r.cfg
    check_cfg = dataclasses.replace(
        cfg,
        launch=dataclasses.replace(cfg.launch, ranks_per_node=1),
        worker=dataclasses.replace(cfg.worker, module=__name__, flags={"dirs": list(dirs)}),
    )
    hostfile = r.run_dir / "hostfile-check"
    hostfile.write_text("".join(f"{n}\n" for n in nodes))
    plan = launcher.build_plan(
        check_cfg, list(nodes), r.executable, r.flavor, dict(cfg.launch.env), r.run_dir, hostfile
    )
    spec = plan.procs[0]
    proc = await asyncio.create_subprocess_exec(
        *spec.argv,
        env={**os.environ, **spec.env},
        cwd=cfg.launch.cwd or None,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=launcher._child_setup,
    )
    lines: list[str] = []

    # Hydra prefixes each chunk a process writes, not each line: a report may come in pieces
    # with another node's between them (seen in a clean-clone run); HydraLines joins them.
    hydra = launcher.HydraLines(len(nodes)) if plan.launcher == "hydra" else None

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            for whole in hydra.feed(raw) if hydra else [raw]:
                lines.append(whole.decode(errors="replace").rstrip("\n"))
        for whole in hydra.flush() if hydra else []:
            lines.append(whole.decode(errors="replace").rstrip("\n"))

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
