"""The program a job runs on each of its nodes at its start and its end (`python -m
supervisor.host.node_clean`): what jobs leave in a node's scratch, removed on that node.

The supervisor removes what its own host holds (`run.node_scratch`); on a real cluster the ranks
keep their memory slots, partner copies and async stage dir on every node, where no supervisor
runs. Here, on each node, through the job's own launcher:

- the memory tier's directories of this user that no live process holds (`memdir.
  sweep_abandoned`): at the job's end its own (its ranks are gone), at any start what a job
  killed with its supervisor left;
- async stage dirs `<tmp>/es-ckpt-<job id>` of a supervised job (`<name>-<8 hex digits>`) that
  no live process of that job on the node names (its `ES_JOB_ID`: its ranks, which make the
  directory, and its fork template carry it); `--job`'s own (the job is over);
- MPICH segments and Hydra topology files nothing holds (`hygiene.sweep`);
- an emulated node's own memory root, once empty.

It prints one line (`MARK` + JSON: the node, what was removed, what could not be) and exits 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import sys
from collections.abc import Iterable, Sequence

from contracts import env_names, scratch
from supervisor.host import hygiene, memdir

MARK = "es-node-clean "
WORKER_TAG = re.compile("[0-9a-f]{12}")  # a worker run by hand: its checkpoint dir's hash
JOB_FLAG = "--job"
STAGE_FLAG = "--stage-root"


def live_job_tags(proc_root: str = "/proc") -> set[str]:
    """The scratch tags of the supervised jobs with a live process on this node (read from
    their environments: ES_JOB_ID)."""
    tags: set[str] = set()
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit()]
    except OSError:
        return tags
    key = (env_names.ENV_JOB_ID + "=").encode()
    for pid in pids:
        try:
            with open(f"{proc_root}/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for entry in env.split(b"\0"):
            if entry.startswith(key):
                tags.add(scratch.scratch_tag(entry[len(key) :].decode(errors="replace")))
    return tags


def stale_stage_dirs(root: str, names: Iterable[str], live: set[str]) -> list[str]:
    """Pure: the stage dirs under `root` a sweep removes: a supervised job's (its tag of the
    form `<name>-<8 hex digits>`), no live process of which is on the node."""
    out = []
    for name in names:
        if not name.startswith(hygiene.STAGE_PREFIX):
            continue
        tag = name.removeprefix(hygiene.STAGE_PREFIX)
        if not scratch.MEM_DIR_NAME.fullmatch(scratch.MEM_PREFIX + tag) or WORKER_TAG.fullmatch(
            tag
        ):
            continue  # a worker's own (run by hand, a 12-digit hash) or not ours at all
        if tag not in live:
            out.append(os.path.join(root, name))
    return out


def sweep_stage_dirs(root: str, own_tag: str | None, proc_root: str = "/proc") -> list[str]:
    """Remove the job's own stage dir (`own_tag`) and the stale ones under `root`."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    uid = os.getuid()
    mine = []  # this user's directories (not a link)
    for name in names:
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            continue
        if st.st_uid == uid and stat.S_ISDIR(st.st_mode):
            mine.append(name)
    live = live_job_tags(proc_root)
    if own_tag is not None:
        live.discard(own_tag)  # the job is over: what still names it is on its way out
    removed = []
    for path in stale_stage_dirs(root, mine, live):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(path)
    return removed


def clean(job: str | None, stage_root: str, env: dict[str, str], node: str) -> dict:
    """Everything above on this node; what was removed and what was left (never raises for a
    path's sake)."""
    removed: list[str] = []
    root = scratch.mem_root(env, node)
    removed += memdir.sweep_abandoned(root)
    tag = scratch.scratch_tag(job) if job else None
    left = []
    if tag is not None and os.path.lexists(scratch.mem_dir(root, tag)):
        left.append(f"{scratch.mem_dir(root, tag)}: still held by a live process")
    removed += sweep_stage_dirs(stage_root, tag)
    removed += hygiene.sweep()
    if scratch.per_node(env) and root != scratch.base_root(env):
        try:
            os.rmdir(root)  # the emulated node's own root, once empty
            removed.append(root)
        except OSError:
            pass
    return {"node": node, "removed": removed, "left": left}


def main(argv: Sequence[str]) -> int:
    """`[--job JOB_ID] [--stage-root DIR]`: one report line for this node."""
    args = list(argv)
    job = args[args.index(JOB_FLAG) + 1] if JOB_FLAG in args[:-1] else None
    stage_root = args[args.index(STAGE_FLAG) + 1] if STAGE_FLAG in args[:-1] else None
    env = dict(os.environ)
    node = env_names.node_name(env, socket.gethostname())
    report = clean(job, stage_root or hygiene.temp_dir(env), env, node)
    print(MARK + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
