"""How the world divides into replicas, shards and tensor-parallel groups: pure, torch-free
(the supervisor checks a config's layout with it before launching anything)."""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import UsageError


@dataclass(frozen=True)
class Layout:
    """How `world` ranks divide into replicas, shards and tensor-parallel groups."""

    world: int
    replicate: int
    shard: int
    tp: int

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    def dims(self) -> list[tuple[str, int]]:
        named = [("dp_replicate", self.replicate), ("dp_shard", self.shard), ("tp", self.tp)]
        kept = [(name, size) for name, size in named if size > 1]
        return kept or [("dp_shard", 1)]

    def describe(self) -> str:
        return "x".join(f"{name}={size}" for name, size in self.dims())

    def dp_rank(self, rank: int) -> int:
        """Data-parallel rank: ranks of one tensor-parallel group see the same batch."""
        return rank // self.tp


def plan_layout(world: int, tp: int, replicate: int) -> Layout:
    """Pure: the layout for these flags, or a UsageError that names the sizes."""
    if tp < 1 or replicate < 1:
        raise UsageError(f"--tp ({tp}) and --replicate ({replicate}) must be at least 1")
    if world % (tp * replicate):
        raise UsageError(
            f"world size {world} is not divisible by --tp {tp} x --replicate {replicate}"
            f" = {tp * replicate}; choose sizes whose product divides {world}"
        )
    return Layout(world=world, replicate=replicate, shard=world // (tp * replicate), tp=tp)


def check_model_fits(layout: Layout, n_heads: int, n_kv_heads: int, ffn_dim: int) -> None:
    if layout.tp == 1:
        return
    for name, size in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_dim", ffn_dim)):
        if size % layout.tp:
            raise UsageError(f"--tp {layout.tp} does not divide {name}={size}")
