"""Continuing a job in its run dir: which settings changed since the run it continues, which of
them break a bit-exact resume (and are refused unless allowed), and what to change first after a
job that ended without finishing. Pure: the configs as tables in, decisions out.

A continued job resumes from its newest checkpoint and, with nothing changed that a step
computes, goes on exactly as the uninterrupted run would have: the same losses bit for bit.
The learning-rate schedule, the model, the data, the seed and the world all decide what a step
computes; a checkpoint dir elsewhere is one the job does not resume from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Worker flags that change how the job saves, logs or waits, never what a step computes.
HARMLESS_FLAGS = frozenset({
    "outdir", "log_every", "metrics_all_ranks", "pg_timeout", "save_interval", "ckpt_keep",
    "ckpt_verify", "save_on_exit", "async_ckpt", "ckpt_stage_dir", "mem_ckpt_interval",
    "mtbf_prior_s", "mem_partner", "guard", "guard_factor", "guard_grad_factor", "guard_warmup",
    "guard_skip_batches",
})  # fmt: skip
_WHY = {
    "the learning-rate schedule depends on it": (
        "train_iters", "lr", "min_lr_ratio", "warmup_iters"),
    "the optimizer's update depends on it": ("weight_decay", "grad_clip"),
    "it is the model": ("model", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                        "vocab_size", "seq_len"),
    "it decides the data each step reads": ("batch_size", "data_path", "data_dtype",
                                            "skip_batches"),
    "it seeds the model and the data": ("seed",),
    "it is the parallel layout": ("tp", "replicate"),
    "it decides how the model is built and run": ("device", "meta_init"),
    "the checkpoints the job resumes from are in the one it had": ("ckpt_dir",),
    "the job would start again from step 0": ("no_resume",),
}  # fmt: skip
BREAKING_FLAGS = {flag: why for why, flags in _WHY.items() for flag in flags}
WORLD = "world"  # the ranks the job runs on, as a key of its own (nodes x ranks_per_node)
SKIPPED = ("job.run_dir",)  # the run dir is the one continued, always


@dataclass(frozen=True)
class Change:
    """One setting that differs from the run continued: `key` as `--set` names it."""

    key: str
    old: Any
    new: Any
    breaks: str | None  # why a continued job would not compute what the run would have; None

    def as_event(self) -> dict[str, Any]:
        return {"key": self.key, "old": self.old, "new": self.new, "breaks": self.breaks}

    @property
    def line(self) -> str:
        """`worker.train_iters: 1500 -> 500`."""
        return f"{self.key}: {shown(self.old)} -> {shown(self.new)}"


def breaks(key: str) -> str | None:
    """Why changing `key` breaks a bit-exact resume, or None when it cannot."""
    if key == WORLD:
        return "the number of ranks decides how the model and the data are split"
    if key == "worker.module":
        return "it is the training program"
    if key.startswith("worker."):
        flag = key.removeprefix("worker.")
        if flag in HARMLESS_FLAGS:
            return None
        return BREAKING_FLAGS.get(flag, "a worker flag not known to leave each step as it was")
    return None


def differences(
    old: Mapping[str, Any], new: Mapping[str, Any], old_world: int | None, new_world: int
) -> list[Change]:
    """Every setting of the new config that differs from the old (both as resolved, tables of
    TOML values), the world first when it changed."""
    out = []
    if old_world is not None and old_world != new_world:
        out.append(Change(WORLD, old_world, new_world, breaks(WORLD)))
    was, now = flatten(old), flatten(new)
    for key in [*now, *(k for k in was if k not in now)]:
        if key in SKIPPED or was.get(key) == now.get(key):
            continue
        out.append(Change(key, was.get(key), now.get(key), breaks(key)))
    return out


def flatten(tables: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"worker": {"lr": 1}}` as `{"worker.lr": 1}`; `[[faults]]` as one value, `faults`."""
    out: dict[str, Any] = {}
    for key, value in tables.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def refused(changes: Iterable[Change], allowed: Iterable[str]) -> list[Change]:
    """The changes that break a bit-exact resume and were not allowed by name."""
    ok = set(allowed)
    return [c for c in changes if c.breaks is not None and c.key not in ok]


def refusal(run_dir: str, job: str, refused_changes: list[Change]) -> str:
    """The one line that refuses them: the first, why, and how to allow them all."""
    first = refused_changes[0]
    more = len(refused_changes) - 1
    also = f" (and {more} more: {', '.join(c.key for c in refused_changes[1:])})" if more else ""
    flags = " ".join(f"--allow-change {c.key}" for c in refused_changes)
    return (
        f"continuing job {job} with {first.line} breaks a bit-exact resume ({first.breaks})"
        f"{also}; keep it as it was, or allow it with {flags}"
    )


def nothing_to_do(ended: str | None, step: int | None, changes: list[Change]) -> str | None:
    """Why a continuation would run nothing: the job finished and nothing was changed."""
    if ended != "DONE" or changes:
        return None
    at = f" at step {step}" if step is not None else ""
    return (
        f"the job finished (DONE{at}): nothing to continue; to train further, raise "
        "worker.train_iters (--set worker.train_iters=N --allow-change worker.train_iters)"
    )


def first_change(
    code_name: str,
    reason: str,
    last_failure: str | None,
    saved: int | None,
    excluded: list[str],
    max_restarts: int | None,
) -> str | None:
    """What to change before continuing a job that ended with this code (None: nothing to
    continue, or nothing the code says). `last_failure`: the newest failed attempt's detail;
    `saved`: the newest checkpoint; `excluded`: the nodes out at the end."""
    failure = f" (the last: {last_failure})" if last_failure else ""
    if code_name == "INTERRUPTED":
        at = f"it resumes from its checkpoint at step {saved}" if saved is not None else (
            "it starts from its newest checkpoint")  # fmt: skip
        return f"nothing needs to change: {at}"
    if code_name == "BUDGET":
        budget = f" of {max_restarts}" if max_restarts is not None else ""
        return (
            f"find why its attempts failed and fix that{failure}: continued as it is, it gets a "
            f"new budget{budget} restarts and may spend it the same way"
        )
    if code_name == "NO_PROGRESS":
        return (
            f"fix what kept it from progressing ({reason}){failure}: continued as it is, it "
            "repeats it"
        )
    if code_name == "NODES":
        out = ", ".join(excluded) or "the nodes it excluded"
        return (
            f"give it good nodes: {out} failed ({reason}); check or replace them "
            "(--set launch.nodes=[...]) or keep a spare (launch.spares): a continued job "
            "starts again on the config's nodes"
        )
    return None


def shown(v: Any) -> str:
    if v is None:
        return "(unset)"
    return str(v).lower() if isinstance(v, bool) else str(v)
