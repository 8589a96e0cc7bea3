"""What the checkpoint code is told by the run: its own settings, not the training loop's flags.

The training loop builds them from its flags (`worker.build.ckpt_settings`); everything under
`worker/ckpt/` reads only these, so it can be driven (a bench, a test) without a command line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CkptSettings:
    """Where checkpoints go, how many stay, how a resume checks them, and which tiers run."""

    ckpt_dir: str | None  # the durable tier (--ckpt-dir); None: nothing saved or resumed
    keep: int  # complete checkpoints kept (--ckpt-keep)
    verify: str  # what a resume checks of each file: "size" or "crc" (--ckpt-verify)
    start_fresh: bool  # resume nothing, drop the memory tier's slots (--no-resume)
    async_save: bool  # saves through host buffers and the stage dir (--async-ckpt)
    stage_dir: str | None  # the async mode's node-local stage dir; None: the default one
    mem_interval: int  # a memory-tier copy every this many steps; 0: no memory tier
    mem_partner: bool  # each copy also held by a rank on the next node (--mem-partner)
    timeout_s: float  # the async saver's process groups' timeout (--pg-timeout)
