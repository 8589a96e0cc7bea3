"""What one attempt starts: its processes (argv, environment, output prefix), its world and
nodes, and the signal that asks its ranks to stop. Built by a launcher kind (`kinds.py`), acted
on by `processes.py`."""

from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from contracts.env_names import ENV_HEARTBEAT_KEY
from supervisor.launch.hydra_lines import HydraLines
from supervisor.settings.config import Config, LaunchConfig, flags_from_table


@dataclass
class ProcSpec:
    """One process to start: its argv, its environment additions, and its output prefix."""

    argv: list[str]
    env: dict[str, str]
    label: str = ""
    rank: int | None = None


@dataclass
class LaunchPlan:
    flavor: str  # local | hydra | pals | srun
    procs: list[ProcSpec]
    world: int
    nodes: list[str]
    stop_signal: signal.Signals = signal.SIGTERM
    # At a teardown, after its ranks here are killed, how long the launcher gets to end by
    # itself (Hydra then ends its proxies and ranks on the other hosts) before it is killed.
    launcher_exit_s: float = 3.0

    def text(self) -> str:
        """The command for command.txt and --dry-run (the HMAC key is never written)."""
        lines = []
        for p in self.procs:
            shown = {k: ("<secret>" if k == ENV_HEARTBEAT_KEY else v) for k, v in p.env.items()}
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(shown.items()))
            lines.append(f"{env} {shlex.join(p.argv)}".strip())
        return "\n".join(lines) + "\n"

    def line_joiner(self) -> HydraLines | None:
        """What makes whole rank lines of the launcher's output, where its prefixes split them
        (Hydra's); None where each line read is whole."""
        return HydraLines(self.world) if self.flavor == "hydra" else None


def python_of(launch: LaunchConfig) -> str:
    """The ranks' Python."""
    return launch.python or sys.executable


TEMPLATE_CLIENT = "worker.template_client"  # started in a rank's place ([restart] template)


def worker_argv(
    cfg: Config, overrides: Mapping[str, object] | None = None, template: bool = False
) -> list[str]:
    """The rank's command; `overrides`: worker flags that differ from [worker] (a shrink);
    `template`: the client that has the node's fork template fork the rank."""
    flags = flags_from_table({**cfg.worker.flags, **overrides}) if overrides else cfg.worker_flags()
    via = [TEMPLATE_CLIENT] if template else []
    return [python_of(cfg.launch), "-m", *via, cfg.worker.module, *flags]
