"""The node-local scratch of a job: the memory tier's directory, its tag and the job-name rule."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import tempfile

from contracts.env_names import ENV_MEM_PER_NODE, ENV_MEM_ROOT, node_name

# --- the memory checkpoint tier's directory -------------------------------------------------------
# One directory per job on every node (`--mem-ckpt-interval`): `<root>/es-mem-<tag>/`, where the tag
# is the job id under the supervisor (`<job name>-<8 hex digits>`), else a hash of the checkpoint
# dir (12 hex digits). It outlives the ranks; whoever uses it (the supervisor for the job's life,
# each rank for its own) holds a shared flock on its LOCK_FILE, so a directory whose lock can be
# taken exclusively belongs to no live job and may be removed (if of exactly this form: a sweep
# touches nothing else, `MEM_DIR_NAME`).
MEM_ROOT_DEFAULT = "/dev/shm"
MEM_PREFIX = "es-mem-"
# A job name (checks.name_problem checks it against these): ASCII letters, digits, ".", "_",
# "-", starting with a letter or digit, at most JOB_NAME_MAX, no "..".
JOB_NAME_MAX = 64
_NAME_FIRST, _NAME_REST = "[A-Za-z0-9]", "[A-Za-z0-9._-]"
JOB_NAME = re.compile(f"{_NAME_FIRST}{_NAME_REST}*", re.ASCII)
# The tag of a job's scratch: a job name, then the job id's 8 hex digits; or a worker's own
# 12-digit hash.
_MEM_TAG = re.compile(
    rf"(?:(?!.*\.\.){_NAME_FIRST}{_NAME_REST}{{0,{JOB_NAME_MAX - 1}}}-[0-9a-f]{{8}}"
    r"|[0-9a-f]{12})",
    re.ASCII,
)
MEM_DIR_NAME = re.compile(re.escape(MEM_PREFIX) + _MEM_TAG.pattern, re.ASCII)


def base_root(env: dict[str, str] | os._Environ) -> str:
    """`ES_MEM_ROOT`, else /dev/shm, else (a system without it) the temp dir: the page cache
    then holds the slots, and the tier still works."""
    if env.get(ENV_MEM_ROOT):
        return env[ENV_MEM_ROOT]
    return MEM_ROOT_DEFAULT if os.path.isdir(MEM_ROOT_DEFAULT) else tempfile.gettempdir()


def per_node(env: dict[str, str] | os._Environ) -> bool:
    """Whether each node has a root of its own under the base (`ES_MEM_PER_NODE`: emulated
    nodes, which share one host)."""
    return env.get(ENV_MEM_PER_NODE) == "1"


def node_root(base: str | os.PathLike, node: str) -> str:
    """`<base>/<node>`: one node's own root (a node name with a separator, or `.`/`..`, by its
    hash, so that it stays one directory right under the base)."""
    safe = (
        node
        if node not in ("", ".", "..") and "/" not in node and "\0" not in node
        else ("node-" + hashlib.sha1(node.encode("utf-8", "surrogatepass")).hexdigest()[:12])
    )
    return os.path.join(base, safe)


def mem_root(env: dict[str, str] | os._Environ, node: str | None = None) -> str:
    """The memory root of a rank with this environment: the base root, or with per-node roots
    its node's own under it (`node`, else the rank's own node name)."""
    base = base_root(env)
    if not per_node(env):
        return base
    return node_root(base, node if node is not None else node_name(env, socket.gethostname()))


def scratch_tag(tag: str) -> str:
    """A job's tag as node-local scratch directories are named by it: as it is when of the form
    a sweep knows; a tag of another form (a job id made by hand: a separator, `..`, a NUL, too
    long) by its hash (12 hex digits), the same for every caller."""
    if _MEM_TAG.fullmatch(tag):
        return tag
    return hashlib.sha1(tag.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def mem_dir(root: str | os.PathLike, tag: str) -> str:
    """`<root>/es-mem-<tag>`: one directory right under `root`, of the form a sweep knows."""
    return os.path.join(root, MEM_PREFIX + scratch_tag(tag))
