"""`python -m worker.prepared <worker flags>`: a prepared rank, with no rank number yet.

The supervisor keeps such processes on every node of a job and on its spares ([restart]
warm_spare), launched one node at a time so that a lost node takes only its own. Each pays the
interpreter's start and the imports a cold start would (torch, the training loop), says phase
`standby` (prepared `imports`) and blocks until the supervisor's signed `become` or `exit`. On
`become` it takes the variables it is given (its rank, the world, the rendezvous address, the
attempt) and runs `worker.train` as that rank: the process group is formed after the word, with
whichever nodes the relaunch uses, a spare in a lost node's place included. Exit status: as
worker.train's once it became a rank; 0 when told to exit or stopped before.

Its identity while it waits: attempt `ES_ATTEMPT` (the prepared ranks' own number) and rank
`ES_PREPARED_BASE` + its rank in its node's launch.
"""

from __future__ import annotations

import os
import sys

from contracts import env_names
from worker import startup
from worker.beat import Beacon
from worker.dist import detect_rank, end_process
from worker.train import StopRequest
from worker.train import main as train_main

# The variables a launcher set for the prepared process, which say nothing of the rank it becomes.
DROPPED_AT_BECOME = (env_names.ENV_PREPARED_BASE, env_names.ENV_PREPARED_WORLD)


def main(argv: list[str] | None = None) -> int:
    stop = StopRequest()  # while it waits: ends it untrained; after `become`: the rank's
    env = os.environ
    needed = (env_names.ENV_HEARTBEAT_ADDR, env_names.ENV_CONTROL_ADDR)
    if not all(env.get(name) for name in needed):
        print(
            f"error: worker.prepared waits for the supervisor's word on its control channel "
            f"({' and '.join(needed)} unset): the supervisor starts it ([restart] warm_spare); "
            "to train, run worker.train",
            file=sys.stderr,
        )
        return 2
    launched = detect_rank(env)
    base = int(env.get(env_names.ENV_PREPARED_BASE, "0"))
    world = int(env.get(env_names.ENV_PREPARED_WORLD, str(launched.world)))
    beacon = Beacon.from_env(base + launched.rank, world)  # no relay: each beats on its own
    beacon.hello("init")
    # The imports a cold start pays: torch and the loop, and torch._dynamo, which FSDP2 imports
    # at its first shard (0.57 s of the model's build, measured here).
    import torch._dynamo  # noqa: F401

    from worker import loop  # noqa: F401

    beacon.standby("imports")
    command = beacon.wait_standby_command(lambda: stop.requested)
    beacon.close()
    if command["action"] != "become" or stop.requested:
        return 0
    for name in DROPPED_AT_BECOME:
        env.pop(name, None)
    env.update(command["env"])
    startup.count_from_now()
    return train_main(argv, stop)


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
