"""The memory tier's copy into its slot, with the checksum's pass folded in: the state's host
bytes are copied into the mapped block about 4 MiB at a time, and each piece's 4 KiB page sums
are taken right after its copy, while it is still in the cache. The data is read once, not
copied and then read again from memory for the checksum; the seal makes each tensor's digest
from the sums (`checksum.digest_of_sums`).

The pieces are a `CopyJob`: the tier's copy worker does them at the lowest priority (nice 19,
`worker.priority.lowest_priority`), and the loop does those still left when it must wait for
the copy. Each piece's copy and sums run without the GIL; a thread holds it only between two pieces.

The plan (which bytes go where, in pieces) is made once for a state dict's containers and
reused while the same ones come back (`StateView` hands the same while they hold the live
tensors): a step's copy is two torch calls a piece, no walk of the state dict.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from worker.ckpt.memory.checksum import PAGE_BYTES, digest_of_sums
from worker.ckpt.staging import ReusedStager

SUM_PIECE = 4 << 20  # bytes copied, then summed while in the cache (the last level)
_WORDS = PAGE_BYTES // 8


@dataclass
class _Piece:
    """A page-aligned run of the block: the copies into it, then its page sums."""

    start: int
    end: int
    dst: list[torch.Tensor] = field(default_factory=list)
    src: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Plan:
    """The copy of one state dict's tensors (held here: its containers' identity keys the
    plan) into the stager's block."""

    model: Any
    optim_state: Any
    pieces: list[tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]]
    scalars: tuple[list[torch.Tensor], list[torch.Tensor]]  # 0-dim tensors: mirror, live
    values_at: Any  # where the state holds no tensor: taken from the state each copy
    # flat key, then: a tensor's mirror and the table's skeleton; a value's path and None
    entries: list[tuple[str, Any, dict[str, Any] | None]]

    def serves(self, state: dict[str, Any]) -> bool:
        return self.model is _part(state, "model") and self.optim_state is _optim_state(state)


class CopyJob:
    """One copy's pieces, each done by whichever thread takes it first: the tier's copy worker,
    at the lowest priority, and the loop when it must wait for the copy (at its own priority:
    what is left then costs the loop no more than copying it itself). Done once every piece
    is, or one failed (`error`)."""

    def __init__(self, pieces: list[tuple]):
        self._pieces = pieces
        self._lock = threading.Lock()
        self._next = 0
        self._left = len(pieces)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.sum_seconds = 0.0  # the page sums' share, every thread's together
        if not pieces:
            self.done.set()

    @torch.no_grad()  # grad mode is per thread
    def work(self) -> None:
        """Take pieces until none is left."""
        while True:
            with self._lock:
                if self._next >= len(self._pieces) or self.error is not None:
                    return
                dst, src, pages, sums = self._pieces[self._next]
                self._next += 1
            try:
                torch._foreach_copy_(dst, src)
                started = time.perf_counter()
                torch.sum(pages, dim=1, out=sums)
                took = time.perf_counter() - started
            except BaseException as exc:  # said by `finish` (the tier goes off)
                with self._lock:
                    self.error = self.error or exc
                self.done.set()
                if not isinstance(exc, Exception):
                    raise
                return
            with self._lock:
                self.sum_seconds += took
                self._left -= 1
                if self._left == 0:
                    self.done.set()


class SlotStager(ReusedStager):
    """`ReusedStager` (same mirror, same loans) whose `stage` also takes the page sums of the
    copy (one int64 per 4 KiB page of the block), and which says the slot's table (`table`:
    each tensor's place and digest, every other value) from them."""

    def __init__(self, allocate: Callable[[int], torch.Tensor]):
        super().__init__(allocate=allocate)
        self._plan: _Plan | None = None
        self._sums: torch.Tensor | None = None
        self._started = 0.0
        self.sum_seconds = 0.0  # the page sums' share of copy_seconds

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The whole copy on this thread (`start`, the pieces, `finish`)."""
        job = self.start(state_dict)
        job.work()
        return self.finish(state_dict, job)

    def start(self, state_dict: dict[str, Any]) -> CopyJob:
        """The copy of `state_dict` as pieces for any thread to do (`CopyJob.work`); then
        `finish`. Maps the slot on its first use."""
        self._started = time.perf_counter()
        return CopyJob(self._plan_for(state_dict).pieces)

    @torch.no_grad()
    def finish(self, state_dict: dict[str, Any], job: CopyJob) -> dict[str, Any]:
        """Once every piece is done: the 0-dim tensors, and the snapshot (the block's tensors,
        what is not a tensor taken from `state_dict`)."""
        job.done.wait()
        if job.error is not None:
            raise job.error
        plan = self._plan
        if plan.scalars[0]:
            torch._foreach_copy_(*plan.scalars)
        staged = _graft(self._cache, state_dict, plan.values_at)
        self.copy_seconds = time.perf_counter() - self._started
        self.sum_seconds = job.sum_seconds
        self._latest = staged
        self._on_staged()
        return staged

    def table(self, staged: dict[str, Any]) -> dict[str, Any]:
        """The slot's table for `staged` (what `stage` returned): each tensor's dtype, shape,
        offset in the block, bytes and digest (from the copy's page sums); a 0-dim tensor's
        and everything else's value (JSON)."""
        sums = self._sums.numpy()
        table: dict[str, Any] = {}
        for key, leaf, skeleton in self._plan.entries:
            if skeleton is None:  # not a tensor: `leaf` is its path
                value = _at(staged, leaf)
                table[key] = {"value": list(value) if isinstance(value, tuple) else value}
            elif "offset" in skeleton:
                first = skeleton["offset"] // PAGE_BYTES
                pages = -(-skeleton["nbytes"] // PAGE_BYTES)
                table[key] = {**skeleton, "digest": digest_of_sums(sums[first : first + pages])}
            else:
                table[key] = {**skeleton, "value": leaf.item()}
        return table

    def close(self) -> None:
        super().close()
        self._plan = self._sums = None

    # ---- the plan ---------------------------------------------------------------------------
    def _plan_for(self, state: dict[str, Any]) -> _Plan:
        if self._plan is not None and self._plan.serves(state):
            return self._plan
        if self._cache is None or not _same_layout(state, self._cache):
            self._allocate(state)  # maps (and zeroes) the slot for this layout
        self._plan = self._make_plan(state)
        return self._plan

    def _make_plan(self, state: dict[str, Any]) -> _Plan:
        """Pieces in block order, each about SUM_PIECE bytes (a larger tensor split at page
        boundaries); a tensor's padding, zero since the slot was mapped and never written,
        makes its last page's sum that of its zero-padded bytes, as `page_sums_crc` counts it."""
        live, _ = flatten_state_dict(state)
        mirror, paths = flatten_state_dict(self._cache)
        base = self._block.data_ptr()
        self._sums = torch.zeros(len(self._block) // PAGE_BYTES, dtype=torch.int64)
        runs, scalars = [], ([], [])
        entries = []
        for key, leaf in mirror.items():
            if not isinstance(leaf, torch.Tensor):
                entries.append((key, paths[key], None))
                continue
            mine, src = _local(leaf), _local(live[key])
            skeleton = {"dtype": str(mine.dtype), "shape": list(mine.shape)}
            entries.append((key, mine, skeleton))
            if mine.dim() == 0:
                scalars[0].append(mine)
                scalars[1].append(src)
                continue
            offset, nbytes = mine.data_ptr() - base, mine.numel() * mine.element_size()
            skeleton.update(offset=offset, nbytes=nbytes)
            if offset % PAGE_BYTES:
                raise ValueError(f"{key} lies at {offset} in the slot, not on a page")
            if nbytes:
                runs.append((offset, nbytes, mine, src))
        pieces = [self._piece_views(p) for p in _pieces(sorted(runs, key=lambda r: r[0]))]
        return _Plan(
            _part(state, "model"),
            _optim_state(state),
            pieces,
            scalars,
            _values_at(state),
            entries,
        )

    def _piece_views(self, piece: _Piece):
        pages = self._block[piece.start : piece.end].view(torch.int64).view(-1, _WORDS)
        sums = self._sums[piece.start // PAGE_BYTES : piece.end // PAGE_BYTES]
        return piece.dst, piece.src, pages, sums


def _pieces(runs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> list[_Piece]:
    """Whole small tensors gathered up to SUM_PIECE bytes a piece; a larger one split into
    pieces of SUM_PIECE (page-aligned), unless it is strided or on an accelerator (one piece:
    its transfer is not cut into many). Each piece ends at the end of its last tensor's
    padding, so the pieces cover every page of the block that holds a tensor's bytes."""
    out: list[_Piece] = []
    current: _Piece | None = None
    for offset, nbytes, dst, src in runs:
        end = offset + -(-nbytes // PAGE_BYTES) * PAGE_BYTES
        if nbytes <= SUM_PIECE:
            if current is None:
                current = _Piece(offset, end)
            current.dst.append(dst)
            current.src.append(src)
            current.end = end
            if current.end - current.start >= SUM_PIECE:
                out.append(current)
                current = None
            continue
        if current is not None:
            out.append(current)
            current = None
        if not src.is_contiguous() or src.device.type != "cpu":
            # copied whole, then summed: strided, or from an accelerator (one transfer)
            out.append(_Piece(offset, end, [dst], [src]))
            continue
        d, s = _bytes_of(dst), _bytes_of(src)
        for lo in range(0, nbytes, SUM_PIECE):
            hi = min(lo + SUM_PIECE, nbytes)
            piece_end = offset + lo + -(-(hi - lo) // PAGE_BYTES) * PAGE_BYTES
            out.append(_Piece(offset + lo, piece_end, [d[lo:hi]], [s[lo:hi]]))
    if current is not None:
        out.append(current)
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes (a view): the copy splits it at any byte."""
    return t.detach().view(-1).view(torch.uint8)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _part(state: dict[str, Any], key: str) -> Any:
    return state.get(key) if isinstance(state, dict) else None


def _optim_state(state: dict[str, Any]) -> Any:
    optim = _part(state, "optim")
    return optim.get("state") if isinstance(optim, dict) else None


def _same_layout(state: dict[str, Any], mirror: dict[str, Any]) -> bool:
    """Whether the mirror (the block's views) has the state's entries, dtypes and shapes."""
    live, _ = flatten_state_dict(state)
    mine, _ = flatten_state_dict(mirror)
    if live.keys() != mine.keys():
        return False
    for key, value in live.items():
        other = mine[key]
        if isinstance(value, torch.Tensor) != isinstance(other, torch.Tensor):
            return False
        if isinstance(value, torch.Tensor):
            a, b = _local(value), _local(other)
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
    return True


# ---- what is not a tensor ---------------------------------------------------------------------
def _has_tensor(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return True
    if isinstance(tree, dict):
        return any(_has_tensor(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_tensor(v) for v in tree)
    return False


def _values_at(tree: Any) -> Any:
    """Where a state dict holds no tensor: None for a whole part without one (taken from the
    live state as it is), else {key or index: where within it}. The optimizer's param groups,
    for one: {"optim": {"param_groups": None}}."""
    if not _has_tensor(tree):
        return None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    inner = {k: _values_at(v) for k, v in items if not isinstance(v, torch.Tensor)}
    return {k: v for k, v in inner.items() if v is None or v}  # parts all tensors: none


def _graft(mirror: Any, state: Any, where: Any) -> Any:
    """The mirror (the block's tensors) with what is not a tensor taken from `state`."""
    if where is None:
        return state
    if not where:
        return mirror
    out = dict(mirror) if isinstance(mirror, dict) else list(mirror)
    for key, inner in where.items():
        out[key] = _graft(mirror[key], state[key], inner)
    return tuple(out) if isinstance(mirror, tuple) else out


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree
