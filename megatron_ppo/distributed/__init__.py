"""Worker groups: one role's TP x PP x DP ranks as Ray actors (or one in-process rank), DP dispatch and gather,
placement, fail-fast. See docs/distributed.md.

Ray is imported only by what needs it (``RayWorkerGroup``, ``create_placement``, ``connect_or_start``), so the
pure parts (layouts, dispatch, placement plans) and ``LocalWorkerGroup`` work without a Ray session.
"""
from megatron_ppo.distributed.cluster import RayCluster, connect_or_start
from megatron_ppo.distributed.dispatch import restore_rows, select_rows, split_rows, token_imbalance
from megatron_ppo.distributed.group import LocalWorkerGroup, WorkerGroup, WorkerGroupError, resolve_worker_class
from megatron_ppo.distributed.layout import (DP_SEED_STRIDE, ClusterSlots, LayoutError, RankCoords, RankLayout,
                                             check_fits, dp_seed)
from megatron_ppo.distributed.placement import (PlacementPlan, RankResources, RolePlacement, create_placement,
                                                plan_placement, remove_placement)
from megatron_ppo.distributed.ray_group import RankActor, RayWorkerGroup

__all__ = [
    "RayCluster", "connect_or_start",
    "restore_rows", "select_rows", "split_rows", "token_imbalance",
    "LocalWorkerGroup", "WorkerGroup", "WorkerGroupError", "resolve_worker_class",
    "DP_SEED_STRIDE", "ClusterSlots", "LayoutError", "RankCoords", "RankLayout", "check_fits", "dp_seed",
    "PlacementPlan", "RankResources", "RolePlacement", "create_placement", "plan_placement", "remove_placement",
    "RankActor", "RayWorkerGroup",
]
