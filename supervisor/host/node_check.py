"""A quick check of every node before the job's first launch, judged by the supervisor.

The job's own launcher runs `node_probe` on each node, one process per node, each printing one
JSON line; a node that prints nothing (its process could not start) or reports a problem is
excluded before it costs an attempt. If no node reports at all, the launcher itself failed: that
says nothing about any one node, and the first attempt will show the real error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contracts import scratch
from supervisor.host import hygiene, memdir, node_probe
from supervisor.host.node_probe import MARK
from supervisor.launch.plan import LaunchPlan
from supervisor.launch.processes import child_setup, helper_process, starting_helper
from supervisor.launch.resolve import Resolved


@dataclass(frozen=True)
class CheckResult:
    failed: dict[str, str]  # node -> why
    reported: int  # nodes that printed a report

    def silent(self) -> list[str]:
        """The nodes that printed no report (a process could not be started there, or the
        launch for all was ended before it could say)."""
        return [node for node, why in self.failed.items() if why == NO_REPORT]


NO_REPORT = "no report: a process could not be started there"


def merge(first: CheckResult, again: CheckResult, retried: Sequence[str]) -> CheckResult:
    """Pure: a check of every node, then of `retried` (its silent ones; all of them when none
    reported) again, each alone (`again`): the second word stands for the nodes it was about.
    Nothing heard from any node is the launcher's failure, not theirs: no result at all."""
    if not first.reported and not again.reported:
        return CheckResult({}, 0)
    failed = {n: why for n, why in first.failed.items() if n not in retried}
    failed |= again.failed if again.reported else {n: NO_REPORT for n in retried}
    return CheckResult(failed, first.reported + again.reported)


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
            failed[node] = NO_REPORT
        elif found[node]:
            failed[node] = "; ".join(found[node])
    return CheckResult(failed, len(found))


def dirs_to_check(flags: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """What the ranks will write on their node: the checkpoint dir, the async stage dir, the
    memory tier's root."""
    dirs = [str(flags["ckpt_dir"])] if flags.get("ckpt_dir") else []
    if flags.get("async_ckpt"):
        dirs.append(str(flags.get("ckpt_stage_dir") or hygiene.temp_dir(env)))
    if memdir.wanted(flags):
        dirs.append(scratch.base_root(dict(env)))  # each emulated node's own root lies under it
    return dirs


async def run_on(
    resolved: Resolved,
    nodes: Sequence[str],
    dirs: Sequence[str],
    timeout: float,
    down: Collection[str] = (),
    each: bool = False,
) -> list[str]:
    """The probe's output lines from one process on each of `nodes`, started by the job's own
    launcher (the same command line the ranks get, one per node; `each`: a launch per node);
    what came before a timeout. `down`: the emulated nodes a fault took away, whose probe then
    answers nothing."""
    flags: dict[str, Any] = {"dirs": list(dirs)}
    if down:
        flags[node_probe.DOWN_FLAG.removeprefix("--")] = sorted(down)
    run = run_each if each else run_program
    return await run(resolved, nodes, node_probe.__name__, flags, timeout, "check")


async def run_each(
    resolved: Resolved,
    nodes: Sequence[str],
    module: str,
    flags: dict[str, Any],
    timeout: float,
    name: str,
) -> list[str]:
    """`run_program` on each node alone, all at once: where one launch for all said nothing (a
    host that does not answer fails a Hydra launch over ssh as a whole), each node answers for
    itself."""
    alone = [
        run_program(resolved, [node], module, flags, timeout, f"{name}-{node}") for node in nodes
    ]
    return [line for lines in await asyncio.gather(*alone) for line in lines]


async def run_program(
    resolved: Resolved,
    nodes: Sequence[str],
    module: str,
    flags: dict[str, Any],
    timeout: float,
    name: str,
) -> list[str]:
    """`python -m module flags` once on each of `nodes` by the job's own launcher; its output
    lines, what came before `timeout` (`name`: of its host file in the run dir)."""
    cfg = resolved.cfg
    check_cfg = dataclasses.replace(
        cfg,
        launch=dataclasses.replace(cfg.launch, ranks_per_node=1),
        worker=dataclasses.replace(cfg.worker, module=module, flags=flags),
    )
    hostfile = resolved.run_dir / f"hostfile-{name}"
    hostfile.write_text("".join(f"{n}\n" for n in nodes))
    plan = resolved.kind.plan(
        check_cfg,
        list(nodes),
        resolved.executable,
        resolved.flavor,
        dict(cfg.launch.env),
        hostfile,
    )
    spec = plan.procs[0]
    with starting_helper():  # its pid comes an await after the fork: ours from the fork on
        proc = await asyncio.create_subprocess_exec(
            *spec.argv,
            env={**os.environ, **spec.env},
            cwd=cfg.launch.cwd or None,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=child_setup,
        )
    with helper_process(proc.pid):
        return await _report(proc, plan, timeout)


async def _report(proc: asyncio.subprocess.Process, plan: LaunchPlan, timeout: float) -> list[str]:
    """The probe's lines, read until it ends or `timeout`; then its process group is gone."""
    lines: list[str] = []

    # Hydra prefixes each chunk a process writes, not each line: a report may come in pieces
    # with another node's between them (seen in a clean-clone run); its joiner makes them whole.
    joiner = plan.line_joiner()

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            for whole in joiner.feed(raw) if joiner else [raw]:
                lines.append(whole.decode(errors="replace").rstrip("\n"))
        for whole in joiner.flush() if joiner else []:
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
