"""The environment the supervisor sets for each rank (and the node name a rank goes by).

Read by the worker, set by the supervisor's launch plan: the one list of `ES_*` names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from contracts.intervals import DURABLE, MEMORY

# --- supervisor -> ranks: environment ---------------------------------------------------------
ENV_JOB_ID = "ES_JOB_ID"
ENV_ATTEMPT = "ES_ATTEMPT"
ENV_HEARTBEAT_ADDR = "ES_HEARTBEAT_ADDR"
ENV_HEARTBEAT_KEY = "ES_HEARTBEAT_KEY"
ENV_ATTEMPT_DIR = "ES_ATTEMPT_DIR"
# Optional: seconds between liveness beats (the supervisor passes its [heartbeat] interval_s).
ENV_HEARTBEAT_INTERVAL = "ES_HEARTBEAT_INTERVAL"
# Optional: "1" asks each rank to die with its parent (PR_SET_PDEATHSIG, and a parent-pid watch
# in the beat thread), so that a supervisor killed with SIGKILL leaves no rank behind.
ENV_EXIT_WITH_PARENT = "ES_EXIT_WITH_PARENT"
# Optional: "1" starts the ranks as a warm standby ([restart] standby): they prepare everything a
# resume does not need (on CPU: imports, process group, model, optimizer, a warm-up of the clip and
# of an update of copies; on an accelerator only the imports), say phase `standby`, and wait for a
# signed `go` (resume and train as attempt ES_ATTEMPT) or `exit` on the control channel, which is
# then always set.
ENV_STANDBY = "ES_STANDBY"
# Optional: where the memory checkpoint tier keeps its node-local directories (default /dev/shm).
ENV_MEM_ROOT = "ES_MEM_ROOT"
# Optional: "1" gives each node its own memory root, `<ES_MEM_ROOT>/<node name>/`: set for
# emulated nodes ([launch] emulate_nodes), whose ranks share one host, so that each node's memory
# tier is its own and a lost node takes only its own away.
ENV_MEM_PER_NODE = "ES_MEM_PER_NODE"
# Optional: "1" makes local rank 0 of each node (with more than one rank on it) its node's relay:
# the node's other ranks send to it over a node-local socket, and it forwards one signed `summary`
# of their beats and steps per interval instead of each rank's beats ([heartbeat] relay).
ENV_HEARTBEAT_RELAY = "ES_HEARTBEAT_RELAY"

# Prepared ranks (worker.prepared, [restart] warm_spare): a node's are launched on their own, so
# each says which rank of all the prepared ones it is: this base plus its rank in its launch, of
# ES_PREPARED_WORLD. Dropped when it becomes a rank.
ENV_PREPARED_BASE = "ES_PREPARED_BASE"
ENV_PREPARED_WORLD = "ES_PREPARED_WORLD"

# Optional: the ZeroMQ address of the supervisor's control socket (a ROUTER, CURVE with keys
# derived from ES_HEARTBEAT_KEY). Set when the job declares faults or keeps a standby; a rank
# connects a DEALER on a routing id of its own (`control_conn(...)`) and claims its identity in
# a signed hello (contracts.control_msgs).
ENV_CONTROL_ADDR = "ES_CONTROL_ADDR"

# Optional: the seconds of a rank's lease (worker.lease; [heartbeat] lease_s), set with
# ES_CONTROL_ADDR: renewed by the control action `lease`; a rank whose lease runs out stops
# writing and SIGKILLs itself (a partition, or a supervisor gone).
ENV_LEASE_S = "ES_LEASE_S"

# Optional: the interval, in steps, that an "auto" tier (`--mem-ckpt-interval auto`,
# `--save-interval auto`) starts with: the supervisor's latest, set at every launch once it has
# one (contracts.intervals; later changes come as the control action `interval`). Unset: the rank
# tunes the tier itself from the prior MTBF until told.
ENV_MEM_CKPT_INTERVAL = "ES_MEM_CKPT_INTERVAL"
ENV_SAVE_INTERVAL = "ES_SAVE_INTERVAL"
INTERVAL_ENV = {MEMORY: ENV_MEM_CKPT_INTERVAL, DURABLE: ENV_SAVE_INTERVAL}

# The umask (octal digits, e.g. "077") a rank takes before it writes anything: the supervisor's
# own ([job] share_with_group), which ranks on other hosts do not inherit, so that what they write
# (metrics, stacks, checkpoints) is no more open to other users than the run dir.
ENV_UMASK = "ES_UMASK"
UMASK_DIGITS = re.compile(r"[0-7]{1,4}")

# Tests only: the failure points to arm in the ranks and the pre-launch node check
# (`contracts.inject`), e.g. "rank=1,raise_at_step=5".
ENV_INJECT = "ES_INJECT"

# The launcher's own name for a rank's node (Hydra's emulated nodes run on one host under
# several names), else the host name: what relays and the pre-launch node check go by.
NODE_NAME_VARS = ("PMI_HOSTNAME", "SLURMD_NODENAME")


def node_name(env: dict[str, str] | os._Environ, hostname: str) -> str:
    return next((env[v] for v in NODE_NAME_VARS if env.get(v)), hostname)


def umask_of(env: Mapping[str, str]) -> int | None:
    """`ES_UMASK` as a number; None when it is unset or empty. ValueError for a value that is
    not 1 to 4 octal digits."""
    text = env.get(ENV_UMASK, "")
    if not text:
        return None
    if not UMASK_DIGITS.fullmatch(text):
        raise ValueError(f"{ENV_UMASK}={text!r} is not a umask (1 to 4 octal digits, e.g. 077)")
    return int(text, 8)
