"""Where a (re)start's seconds go, timed from the process's own start.

The start comes from the kernel (the process's age from /proc/self/stat against the boot
clock), so the figure includes the interpreter and every import even though this module is
imported late; psutil's create_time rests on a whole-second boot time and read ~0.4 s early here.
A warm standby (worker.standby) prepares from its own start and restarts its clock at `go`: its
restart costs only what follows the supervisor's word.
"""

from __future__ import annotations

import os
import time


def process_start_time() -> float:
    """Wall-clock time this process started, to the kernel's clock tick."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        started_s = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_s
        return time.time() - max(0.0, age)
    except (OSError, IndexError, ValueError, AttributeError):  # not Linux
        return time.time()


PROCESS_START = process_start_time()


def count_from_now() -> None:
    """A prepared rank (worker.prepared) told which rank to become: its start, as the rank it
    becomes counts it, is now (its interpreter and imports were paid before the failure)."""
    global PROCESS_START
    PROCESS_START = time.time()


# The parts of a (re)start, in order: `choose` picks the checkpoint and starts reading it.
PARTS = ("imports", "process_group", "choose", "model_build", "load", "first_step")


class Startup:
    """Wall-clock marks from the process's own start: where a (re)start's seconds go."""

    def __init__(self):
        self.last = PROCESS_START
        self.parts: dict[str, float] = {}
        self.began = PROCESS_START  # what `total` counts from: the process start, or `go`
        self.prepare_seconds: float | None = None  # a standby's process start -> ready

    def mark(self, name: str) -> None:
        now = time.time()
        self.parts[f"startup/{name}"] = now - self.last
        self.last = now

    def ready(self) -> None:
        """A standby is ready: what it prepared took this long (from the process start)."""
        self.prepare_seconds = self.last - PROCESS_START

    def go(self) -> None:
        """A standby was told to go (after `mark("standby_wait")`): the restart counts from now."""
        self.began = self.last

    @property
    def total(self) -> float:
        return self.last - self.began
