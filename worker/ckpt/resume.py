"""Which checkpoint a (re)start resumes from, chosen before the model is built.

Rank 0 picks the newest complete checkpoint whose files verify and every rank learns the choice;
with this run's own world and mesh each rank then pulls its shard file into the page cache while
the model is built (`startup/choose`). The load itself is `Checkpointer.load`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import ckpt_files, env_names, fences
from worker import collectives
from worker.ckpt import memory, rng, safe_load, storage
from worker.ckpt.memory.held import Held
from worker.ckpt.ports import Reporter
from worker.ckpt.settings import CkptSettings

DCP_METADATA = ".metadata"
MAX_FETCH_ROUNDS = 4  # a failed fetch forgets that copy and the ranks choose again


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match (model) or may differ in (mesh: DCP reshards)."""

    model_fingerprint: str
    model_description: str
    world: int
    mesh: str


@dataclass(frozen=True)
class Chosen:
    """What a (re)start resumes from: a durable step dir, every rank's own memory slot of one
    step, or None (a fresh start). `why`: what the memory tier passed over and why (a slot a
    rank refused, with the rank), the same text on every rank; None when nothing was."""

    source: Path | memory.MemoryChoice | None
    why: str | None = None


def choose(
    settings: CkptSettings,
    rank: int,
    identity: RunIdentity,
    beacon: Reporter,
    say: Callable,
    host: str,
) -> Chosen:
    """Collective: the checkpoint to resume from (a durable step dir, or every rank's own memory
    slot of one step), None to start fresh; a durable one's files start to be read at once."""
    if not settings.ckpt_dir:
        return Chosen(None)
    expect = memory_expect(settings, rank, identity, host)
    if settings.start_fresh:
        if expect is not None:  # a fresh timeline: never resume the old one's memory later
            memory.forget(memory_dir(settings), rank)
            memory.forget_held(memory_dir(settings))
        return Chosen(None)
    beacon.phase("load", 0)
    chosen = choose_tiers(
        Path(settings.ckpt_dir),
        rank=rank,
        verify=settings.verify,
        memory_at=(memory_dir(settings), expect) if expect is not None else None,
        say=say,
        partner=settings.mem_partner,
    )
    if isinstance(chosen.source, Path):
        start_reading(
            chosen.source, ckpt_files.read_meta(chosen.source), rank=rank, identity=identity
        )
    return chosen


def choose_tiers(
    root: Path,
    *,
    rank: int,
    verify: str,
    memory_at: tuple[Path, memory.Expect] | None,
    say: Callable,
    why: str | None = None,
    partner: bool = False,
) -> Chosen:
    """Collective: the memory tier first (when `memory_at`: its directory and what a slot must
    match; `partner`: partner copies count too), else the newest durable checkpoint that
    verifies, else None. `why`: what was passed over before (a slot refused at load), kept in
    front of what this choice passes over."""
    fenced = fences.read_all(root)  # attempts ended: what they wrote after that is refused
    if memory_at is not None:  # before the durable tier is read: it may not be needed
        newest_durable = None
        if rank == 0:
            candidates = ckpt_files.resume_candidates(ckpt_files.scan(root))
            candidates = [f for f in candidates if fences.late_step(f.path, fenced) is None]
            newest_durable = candidates[0].step if candidates else None
        in_memory, passed = choose_memory(*memory_at, newest_durable, say, partner, fenced)
        why = told(why, passed)
        if in_memory is not None:
            return Chosen(in_memory, why)
    chosen = choose_checkpoint(
        root, rank=rank, verify=verify, log=lambda m: say(m, flush=True), fenced=fenced
    )
    if chosen is None:
        say(f"no complete checkpoint in {root}: starting fresh", flush=True)
    return Chosen(chosen, why)


def may_roll_back_to(ckpt_step: int | None, bad_step: int, own_steps: set[int]) -> bool:
    """A rollback of the numerical guard goes only to a checkpoint of this run's own past: one
    it saved or resumed from, of a step before the bad one. A checkpoint directory can hold
    another run's (a run given --no-resume): loading one would swap in that run's weights and
    step."""
    return ckpt_step is not None and ckpt_step < bad_step and ckpt_step in own_steps


def told(why: str | None, more: str | None) -> str | None:
    """`why` and then `more`, unless `why` says it already (a slot torn is seen again when
    the ranks choose again)."""
    if not more or (why and more in why):
        return why
    return f"{why}; {more}" if why else more


def memory_dir(settings: CkptSettings) -> Path:
    tag = ckpt_files.job_tag(settings.ckpt_dir, os.environ.get(env_names.ENV_JOB_ID))
    return memory.job_dir(os.environ, tag)


def memory_expect(
    settings: CkptSettings, rank: int, identity: RunIdentity, host: str
) -> memory.Expect | None:
    """What this rank's memory slots must match; None without the memory tier."""
    if not settings.mem_interval:
        return None
    tag = ckpt_files.job_tag(settings.ckpt_dir, os.environ.get(env_names.ENV_JOB_ID))
    return memory.Expect(
        job=tag,
        rank=rank,
        world=identity.world,
        mesh=identity.mesh,
        model_fingerprint=identity.model_fingerprint,
        host=host,
    )


def choose_memory(
    directory: Path,
    expect: memory.Expect,
    newest_durable: int | None,
    say: Callable,
    partner: bool = False,
    fenced: dict[tuple[str, int], fences.Fence] | None = None,
) -> tuple[memory.MemoryChoice | None, str | None]:
    """Collective: every rank's slot of the newest step that every rank holds complete (itself,
    or with `partner`, through the copy a rank of another node holds: fetched now), when it is
    newer than the newest complete durable checkpoint (`newest_durable`: rank 0's word); None,
    on every rank alike, on any doubt. Also what was refused (a slot torn, damaged, of another
    run), with the first rank that refused one: the same text on every rank."""
    passed = None
    for _ in range(MAX_FETCH_ROUNDS):
        try:
            memory.hold(directory)
            held, refused = memory.find(directory, expect)
            holding = memory.find_held(directory, expect) if partner else {}
            if fenced:  # copies a cut-off rank made after its attempt was fenced
                held = _not_late(held, fenced, refused)
                holding = {w: _not_late(c, fenced, refused) for w, c in holding.items()}
        except OSError as exc:  # this rank holds nothing usable; the agreement still needs it
            held, holding, refused = [], {}, [f"{directory}: {exc.strerror or exc}"]
        agreed = memory.agree(held, newest_durable, holding)
        telling = [r for r in refused if not r.endswith(": missing")]  # a slot never written
        why = told(passed, memory.first_refusal("; ".join(telling) or None))
        durable = "none" if agreed.durable is None else f"step {agreed.durable}"
        if agreed.step is None:
            if len(agreed.without) < expect.world:  # some rank held a copy: say why not used
                say(
                    f"memory tier: no step held complete by every rank (none on rank(s) "
                    f"{_ranks(agreed.without)}; {why or 'nothing refused'}): "
                    f"resuming from the durable tier ({durable})",
                    flush=True,
                )
            return None, why
        if not agreed.use_memory:
            say(
                f"memory tier: step {agreed.step} is not newer than the durable {durable}: "
                "resuming from the durable tier",
                flush=True,
            )
            return None, why
        mine = next((h for h in held if h.step == agreed.step), None)
        if agreed.fetch:
            fetched, problem, failed = memory.fetch(
                agreed.step,
                agreed.fetch,
                job_dir=directory,
                expect=expect,
                own=held,
                holding=holding,
            )
            mine = fetched or mine
            if failed:
                passed = told(why, memory.first_refusal(problem))
                say(f"memory tier: a partner copy refused: {passed}; choosing again", flush=True)
                continue
            say(
                f"memory tier: step {agreed.step} from partner copies for rank(s) "
                f"{_ranks([r for r, _ in agreed.fetch])} (durable: {durable})",
                flush=True,
            )
        else:
            say(
                f"memory tier: every rank holds step {agreed.step} (durable: {durable})", flush=True
            )
        if why:
            say(f"memory tier: refused: {why}", flush=True)
        return memory.MemoryChoice(agreed.step, mine, bool(agreed.fetch)), why
    return None, passed


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def choose_checkpoint(
    root: Path,
    *,
    rank: int,
    verify: str,
    log: Callable[[str], None],
    fenced: dict[tuple[str, int], fences.Fence] | None = None,
) -> Path | None:
    """Collective: rank 0 picks the newest complete checkpoint whose files verify (a damaged
    one is reported and the one before tried; one a fenced attempt marked after its fence is
    removed); every rank learns the choice."""
    choice = None
    if rank == 0:
        for found in ckpt_files.resume_candidates(ckpt_files.scan(root)):
            late = fences.late_step(found.path, fenced or {})
            if late is not None:
                log(f"WARNING: {_refuse(found.path, fenced or {})}: {late}")
                continue
            problem = _problem(found.path, verify == "crc")
            if problem is None:
                choice = str(found.path)
                break
            log(f"WARNING: skipping checkpoint {found.path.name}: {problem}; trying the one before")
    choice = collectives.broadcast_json(choice, src=0)
    return Path(choice) if isinstance(choice, str) else None


def _refuse(directory: Path, fenced: dict[tuple[str, int], fences.Fence]) -> str:
    """Remove a checkpoint written after its attempt's fence; keep one of no known time (it
    may be a good one, damaged) or one that cannot be removed (a read-only dir): refused
    either way (`fences.discard`). What was done, the warning's start."""
    kept = fences.discard(directory, fenced)
    if kept is None:
        return f"removing checkpoint {directory.name}"
    return f"skipping checkpoint {directory.name}" + (f" ({kept})" if kept else "")


def _not_late(
    held: list[Held], fenced: dict[tuple[str, int], fences.Fence], refused: list[str]
) -> list[Held]:
    """The copies no fenced attempt wrote after its fence; the others' reasons go to `refused`."""
    kept = []
    for h in held:
        late = fences.late(h.record.get("writer"), h.record.get("saved_at"), fenced)
        if late is None:
            kept.append(h)
        else:
            refused.append(f"{h.path}: {late}")
    return kept


def _problem(directory: Path, check_crc: bool) -> str | None:
    try:
        meta = ckpt_files.read_meta(directory)
    except (OSError, ValueError, RecursionError) as exc:
        return f"unreadable {ckpt_files.META}: {exc}"
    if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
        return f"{ckpt_files.META} is not a checkpoint's record"
    problem = ckpt_files.verify_problem(directory, meta.get("files", {}), check_crc)
    if problem is None:
        problem = _unsafe(directory, meta)
    return problem


def _unsafe(directory: Path, meta: dict[str, Any]) -> str | None:
    """What in the checkpoint is not a checkpoint's (a crafted pickle, a foreign record): read
    with the restricted readers, never run."""
    try:
        if (directory / DCP_METADATA).exists():
            safe_load.load_metadata(directory / DCP_METADATA)
        records = meta.get("rng") or []
        if not isinstance(records, list):
            raise safe_load.UnsafeCheckpoint(f"{directory / ckpt_files.META}: rng is not a list")
        for rank, record in enumerate(records):
            rng.parse(record, f"{directory / ckpt_files.META} (rank {rank})")
    except (OSError, safe_load.UnsafeCheckpoint) as exc:
        return f"refused, it is not a checkpoint's content: {exc}"
    return None


def start_reading(
    directory: Path, meta: dict[str, Any], *, rank: int, identity: RunIdentity
) -> None:
    """With this run's world and mesh, rank r's shards are rank r's file: pull it into the
    page cache in the background (a 300 MB load went from 0.27 s to 0.21 s here with the
    planning overlapped). Resharding reads parts of other files; only DCP's plan says which.
    `meta`: the checkpoint's `meta.json` record."""
    if meta.get("world") == identity.world and meta.get("mesh") == identity.mesh:
        storage.read_ahead(directory / storage.shard_name(rank))
