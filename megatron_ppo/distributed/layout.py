"""Rank layouts: TP x PP x DP ranks of one role, numbered the way megatron-core numbers them.

megatron-core 0.16.1 ``initialize_model_parallel(order="tp-cp-ep-dp-pp")`` (the default) builds its groups with
``RankGenerator``: with cp = ep = 1 a global rank is

    rank = tp_rank + tp * dp_rank + tp * dp * pp_rank

so TP peers are adjacent ranks, DP replicas come next and pipeline stages are the outermost blocks. The worker
group starts rank r with these coordinates; tests check them against parallel_state on real ranks.

Pure (no torch, no Ray): the driver checks a layout before any process starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple

from megatron_ppo.errors import UsageError

__all__ = ["RankCoords", "RankLayout", "ClusterSlots", "LayoutError", "check_fits", "dp_seed", "DP_SEED_STRIDE"]

DP_SEED_STRIDE = 1000


class LayoutError(UsageError):
    """A layout the hardware cannot host, or a world that does not divide into the layout."""


class RankCoords(NamedTuple):
    tp: int
    pp: int
    dp: int

    def __str__(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp}"


@dataclass(frozen=True)
class RankLayout:
    """One role's parallel layout: ``tp`` x ``pp`` x ``dp`` ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"RankLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def for_world(cls, tp: int, pp: int, world_size: int, role: str = "role") -> "RankLayout":
        """The layout that fills ``world_size`` ranks with TP x PP model replicas (dp = world / (tp * pp))."""
        if world_size % (tp * pp):
            raise LayoutError(f"{role}: {world_size} ranks do not divide into TP={tp} x PP={pp} = {tp * pp} "
                              "ranks per model replica")
        return cls(tp, pp, world_size // (tp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> RankCoords:
        """Global rank -> (tp, pp, dp) coordinates (megatron's default tp-dp-pp ordering)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a world of {self.world_size} ({self})")
        return RankCoords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def rank_of(self, tp: int, pp: int, dp: int) -> int:
        for name, value, size in (("tp", tp, self.tp), ("pp", pp, self.pp), ("dp", dp, self.dp)):
            if not 0 <= value < size:
                raise LayoutError(f"{name}={value} outside 0..{size - 1} ({self})")
        return tp + self.tp * dp + self.tp * self.dp * pp

    def dp_group(self, dp: int) -> list[int]:
        """All ranks (TP and PP peers) that serve DP replica ``dp``; they receive the same data shard."""
        return sorted(self.rank_of(t, p, dp) for t in range(self.tp) for p in range(self.pp))

    def representative(self, dp: int) -> int:
        """The rank whose answer stands for DP replica ``dp``: tp=0 on the last pipeline stage (it holds the
        model's outputs; its TP peers hold the same values or other vocab shards)."""
        return self.rank_of(0, self.pp - 1, dp)

    @property
    def representatives(self) -> list[int]:
        return [self.representative(d) for d in range(self.dp)]

    def __str__(self) -> str:
        return f"TP={self.tp} x PP={self.pp} x DP={self.dp} = {self.world_size} ranks"


@dataclass(frozen=True)
class ClusterSlots:
    """What the cluster offers: ``nnodes`` x ``per_node`` rank slots (GPUs, or CPU processes on CPU)."""

    nnodes: int
    per_node: int
    kind: str = "GPU"

    @property
    def total(self) -> int:
        return self.nnodes * self.per_node

    def __str__(self) -> str:
        return (f"{self.total} {self.kind} slots (cluster.nnodes x cluster.n_gpus_per_node = "
                f"{self.nnodes} x {self.per_node})")


def check_fits(layouts: Mapping[str, RankLayout], slots: ClusterSlots, placement: str = "colocated") -> None:
    """Refuse, with the arithmetic, layouts the cluster cannot host (called before any process starts).

    colocated: every role shares the same bundles, so the largest role must fit; split: the roles' ranks add up.
    """
    if placement not in ("colocated", "split"):
        raise LayoutError(f"placement={placement!r}; choose 'colocated' or 'split'")
    if not layouts:
        raise LayoutError("no roles to place")
    sizes = {role: layout.world_size for role, layout in layouts.items()}
    detail = "; ".join(f"{role} {layout}" for role, layout in layouts.items())
    if placement == "colocated":
        role = max(sizes, key=sizes.get)
        if sizes[role] > slots.total:
            raise LayoutError(f"{role} {layouts[role]} but the cluster offers {slots} "
                              f"(colocated placement: the largest role must fit; roles: {detail})")
    else:
        need = sum(sizes.values())
        if need > slots.total:
            terms = " + ".join(f"{role} {n}" for role, n in sizes.items())
            raise LayoutError(f"split placement needs {terms} = {need} ranks but the cluster offers {slots} "
                              f"(roles: {detail})")


def dp_seed(seed: int, dp_rank: int) -> int:
    """The sampling seed of DP replica ``dp_rank``: ``seed + 1000 * dp_rank``.

    DP replicas sample different continuations, reproducibly (same seed and layout, same tokens); TP/PP peers of
    one replica share the seed, since they must draw the same tokens. Two (seed, replica) pairs collide only when
    the seeds differ by a multiple of 1000: a driver that moves the seed per step (seed + step) stays distinct for
    fewer than 1000 steps, so a longer run should use e.g. ``dp_seed(seed + 1000 * dp_size * step, dp_rank)``.
    """
    if dp_rank < 0:
        raise LayoutError(f"dp_rank must be >= 0, got {dp_rank}")
    return seed + DP_SEED_STRIDE * dp_rank
