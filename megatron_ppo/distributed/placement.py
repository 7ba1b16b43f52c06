"""Where each role's ranks run: Ray placement groups for ``colocated`` and ``split`` placement.

colocated (the default, verl's hybrid-engine arrangement): all roles share ONE placement group of
``max(world sizes)`` bundles; rank r of every role sits on bundle r. megatron's parallel_state is process-global, so
one process cannot hold two layouts: each role keeps its own processes, and the roles sharing a bundle split its
resources (each asks for ``bundle / n_roles`` CPUs and GPUs). The roles take turns (generate, then evaluate, then
update), so a rank's torch thread count is the whole bundle, not its accounting share.

split: one placement group per role, ``world size`` full bundles each; the roles' ranks add up.

A bundle's CPUs (``cluster.num_cpus_per_rank``) default to ``auto``: the node's CPUs over the ranks placed on it
(``auto_cpus_per_rank``), so a rank's torch thread count is what it really has. A fixed 1 left a one-rank-per-role
run on a 2-core machine at one thread (slower than HF ``generate`` with two: docs/bench/peer.md), and 63 of 64
cores idle on a big CPU node.

``plan_placement`` is pure (tests and the driver's pre-flight); ``create_placement`` asks Ray for the groups and
fails with the arithmetic if Ray cannot reserve them within a timeout (instead of pending forever).

Across nodes: Ray's PACK fills nodes but numbers bundles in no promised node order, while Megatron's rank order
(layout.py: TP peers adjacent, then DP, then PP) assumes consecutive ranks share a node. ``create_placement`` asks
Ray where each bundle landed and seats rank r on the r-th bundle in node order (``node_ordered_bundles``), so a TP
group of a node-sized multiple stays inside one node; ``rank_table`` is the resulting rank -> node table (the
driver logs it, a lost node is named with the ranks it held) and ``split_tp_groups`` lists TP groups that still
span nodes (the driver warns: TP traffic would cross the network).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from megatron_ppo.distributed.layout import ClusterSlots, LayoutError, RankLayout, check_fits

__all__ = ["RankResources", "RolePlacement", "PlacementPlan", "NodeInfo", "plan_placement", "create_placement",
           "remove_placement", "auto_cpus_per_rank", "bundles_per_node", "local_cpu_count", "ray_node_cpu_count",
           "node_ordered_bundles", "planned_bundle_nodes", "rank_table", "split_tp_groups", "format_rank_table",
           "rank_span", "node_key"]


@dataclass(frozen=True)
class NodeInfo:
    """A node as the rank table names it: hostname, address, and Ray's node id ('' in a plan)."""

    host: str
    ip: str = ""
    node_id: str = ""

    def __str__(self) -> str:
        return f"{self.host} ({self.ip})" if self.ip and self.ip != self.host else self.host


@dataclass(frozen=True)
class RankResources:
    """What one rank's bundle holds (per-rank ``num_cpus`` / ``num_gpus`` from the config)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def __post_init__(self):
        if self.num_cpus < 0 or self.num_gpus < 0 or self.num_cpus + self.num_gpus <= 0:
            raise LayoutError(f"RankResources: num_cpus={self.num_cpus}, num_gpus={self.num_gpus}; a rank needs "
                              "a positive amount of CPU or GPU")

    def bundle(self) -> dict[str, float]:
        out = {"CPU": self.num_cpus}
        if self.num_gpus:
            out["GPU"] = self.num_gpus
        return out


@dataclass
class RolePlacement:
    """One role's seats: the placement-group ``pool``, the bundle of each rank, and what each rank reserves.

    ``pg`` is the Ray PlacementGroup once created (None in a plan). ``threads`` is the torch thread count of a rank.
    ``nodes``: the node of each rank's bundle (once created; a plan's assumed PACK order in ``planned_bundle_nodes``).
    """

    pool: str
    bundle_indices: list[int]
    num_cpus: float
    num_gpus: float
    threads: int
    pg: Any = None
    nodes: list = field(default_factory=list)


@dataclass
class PlacementPlan:
    mode: str
    pools: dict[str, list[dict[str, float]]]  # pool name -> bundles
    roles: dict[str, RolePlacement]
    groups: dict[str, Any] = field(default_factory=dict)  # pool name -> PlacementGroup, once created


def _share(amount: float, n: int) -> float:
    """amount / n, in a form Ray accepts: fractions below 1 (4 decimals, rounded down so n shares fit) or whole
    numbers (Ray refuses fractional quantities above 1)."""
    if amount == 0:
        return 0.0
    share = amount / n
    if share > 1:
        return float(math.floor(share))
    return math.floor(share * 10_000) / 10_000


def bundles_per_node(layouts: Mapping[str, RankLayout], slots: ClusterSlots, mode: str = "colocated") -> int:
    """Ranks' bundles on the fullest node: the plan's bundles (colocated: the largest role's world; split: the sum),
    packed (Ray's PACK) up to ``slots.per_node`` a node."""
    sizes = [layout.world_size for layout in layouts.values()]
    bundles = max(sizes) if mode == "colocated" else sum(sizes)
    return max(1, min(bundles, slots.per_node))


def auto_cpus_per_rank(node_cpus: int, ranks_on_node: int) -> int:
    """``cluster.num_cpus_per_rank: auto``: the node's CPUs shared by the bundles placed on it, whole CPUs (Ray
    refuses fractions above 1), at least 1."""
    if node_cpus < 1 or ranks_on_node < 1:
        raise LayoutError(f"auto CPUs per rank: node_cpus={node_cpus}, ranks_on_node={ranks_on_node}; both must be "
                          ">= 1")
    return max(1, node_cpus // ranks_on_node)


def local_cpu_count() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cgroup cpusets, Slurm's binding), not the host's."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ray_node_cpu_count() -> int:
    """The smallest CPU count of the connected Ray cluster's alive nodes (every node must host its share): each
    node's declared CPUs (``ray start --num-cpus``), capped at this process's CPUs for a node on this host (a
    session that declares more CPUs than the machine has must not oversubscribe it)."""
    import ray

    here = ray.util.get_node_ip_address()
    cpus = []
    for node in ray.nodes():
        declared = int(node.get("Resources", {}).get("CPU", 0))
        if node.get("Alive") and declared > 0:
            cpus.append(min(declared, local_cpu_count()) if node.get("NodeManagerAddress") == here else declared)
    if not cpus:
        raise LayoutError(f"the Ray cluster has no node with CPUs ({ray.cluster_resources()}); cannot size "
                          "cluster.num_cpus_per_rank=auto: set a number")
    return min(cpus)


def plan_placement(layouts: Mapping[str, RankLayout], slots: ClusterSlots, mode: str = "colocated",
                   resources: RankResources = RankResources()) -> PlacementPlan:
    """Bundles and per-rank reservations for ``layouts`` ({role: RankLayout}); refuses what does not fit."""
    check_fits(layouts, slots, mode)
    bundle = resources.bundle()
    threads = max(1, int(resources.num_cpus))
    if mode == "colocated":
        n = max(layout.world_size for layout in layouts.values())
        cpus, gpus = _share(resources.num_cpus, len(layouts)), _share(resources.num_gpus, len(layouts))
        if (resources.num_cpus and cpus == 0) or (resources.num_gpus and gpus == 0):
            raise LayoutError(f"colocated placement: {len(layouts)} roles cannot share a bundle of {bundle}")
        roles = {role: RolePlacement("colocated", list(range(layout.world_size)), cpus, gpus, threads)
                 for role, layout in layouts.items()}
        return _with_planned_nodes(PlacementPlan(mode, {"colocated": [dict(bundle) for _ in range(n)]}, roles),
                                   slots.per_node)
    pools = {role: [dict(bundle) for _ in range(layout.world_size)] for role, layout in layouts.items()}
    roles = {role: RolePlacement(role, list(range(layout.world_size)), resources.num_cpus, resources.num_gpus,
                                 threads) for role, layout in layouts.items()}
    return _with_planned_nodes(PlacementPlan(mode, pools, roles), slots.per_node)


def _with_planned_nodes(plan: PlacementPlan, per_node: int) -> PlacementPlan:
    """Each role's ``nodes`` as PACK would fill the nodes, pool after pool (replaced by Ray's answer once the
    groups exist)."""
    offset = 0
    for pool, bundles in plan.pools.items():
        nodes = planned_bundle_nodes(offset + len(bundles), per_node)[offset:]
        offset += len(bundles)
        for rp in plan.roles.values():
            if rp.pool == pool:
                rp.nodes = [nodes[b] for b in rp.bundle_indices]
    return plan


def create_placement(plan: PlacementPlan, *, strategy: str = "PACK", ready_timeout_s: float = 60.0,
                     name_prefix: str = "megatron_ppo") -> PlacementPlan:
    """Reserve the plan's placement groups in the connected Ray cluster and attach them to the roles.

    A group Ray cannot reserve within ``ready_timeout_s`` (the cluster lacks the resources) is removed, and the
    error states what was asked and what the cluster has.
    """
    import ray
    from ray.util.placement_group import placement_group

    try:
        for pool, bundles in plan.pools.items():
            pg = placement_group(bundles, strategy=strategy, name=f"{name_prefix}_{pool}")
            plan.groups[pool] = pg
            ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
            if not ready:
                raise LayoutError(
                    f"placement group {pool!r}: Ray could not reserve {len(bundles)} bundles of {bundles[0]} "
                    f"({strategy}) within {ready_timeout_s:.0f} s; the cluster has {ray.cluster_resources()} "
                    f"in total and {ray.available_resources()} free")
        bundle_nodes = {pool: _bundle_nodes(pg) for pool, pg in plan.groups.items()}
    except BaseException:
        remove_placement(plan)
        raise
    for rp in plan.roles.values():
        rp.pg = plan.groups[rp.pool]
        seat_by_node(rp, bundle_nodes[rp.pool])
    return plan


def seat_by_node(rp: RolePlacement, bundle_nodes: list[NodeInfo]) -> None:
    """Rank r of the role -> the r-th bundle of its pool in node order (colocated roles share the order, so rank r
    of every role still shares a bundle)."""
    order = node_ordered_bundles([n.node_id or n.host for n in bundle_nodes])
    rp.bundle_indices = order[:len(rp.bundle_indices)]
    rp.nodes = [bundle_nodes[b] for b in rp.bundle_indices]


def node_ordered_bundles(bundle_nodes: Sequence[str]) -> list[int]:
    """Bundle indices grouped by node: nodes in the order of their lowest bundle, bundles in index order within a
    node. ``bundle_nodes[b]`` names bundle b's node."""
    first: dict[str, int] = {}
    for b, node in enumerate(bundle_nodes):
        first.setdefault(node, b)
    return sorted(range(len(bundle_nodes)), key=lambda b: (first[bundle_nodes[b]], b))


def planned_bundle_nodes(n_bundles: int, per_node: int) -> list[NodeInfo]:
    """Where PACK puts ``n_bundles`` one-slot bundles on nodes of ``per_node`` slots: bundle b on node b // per_node
    (named node0, node1, ...): the plan's table, before any cluster exists."""
    if per_node < 1:
        raise LayoutError(f"per_node={per_node}: a node needs at least one slot")
    return [NodeInfo(f"node{b // per_node}") for b in range(n_bundles)]


def _bundle_nodes(pg) -> list[NodeInfo]:
    """The node of each bundle of a ready placement group, named from ``ray.nodes()``."""
    import ray
    from ray.util import placement_group_table

    table = placement_group_table(pg)
    where = table.get("bundles_to_node_id") or {}
    nodes = {n["NodeID"]: n for n in ray.nodes()}
    out = []
    for b in range(len(table["bundles"])):
        node_id = where.get(b, "")
        info = nodes.get(node_id, {})
        out.append(NodeInfo(info.get("NodeManagerHostname", node_id[:8] or "?"), info.get("NodeManagerAddress", ""),
                            node_id))
    return out


def rank_table(layouts: Mapping[str, RankLayout], plan: PlacementPlan) -> list[dict]:
    """One record per rank of every role: role, rank, tp, pp, dp, pool, bundle, node (host), ip, node_id (Ray's;
    '' in a plan). Several Ray nodes on one host (ray.cluster_utils) share host and ip: node_id tells them apart."""
    rows = []
    for role, layout in layouts.items():
        rp = plan.roles[role]
        for rank in range(layout.world_size):
            c = layout.coords(rank)
            node = rp.nodes[rank] if rank < len(rp.nodes) else NodeInfo("?")
            rows.append({"role": role, "rank": rank, "tp": c.tp, "pp": c.pp, "dp": c.dp, "pool": rp.pool,
                         "bundle": rp.bundle_indices[rank], "node": node.host, "ip": node.ip,
                         "node_id": node.node_id})
    return rows


def node_key(row: Mapping) -> str:
    """What tells a rank table record's node apart: Ray's node id, else (a plan) the node name."""
    return row.get("node_id") or row["node"]


def split_tp_groups(layout: RankLayout, rank_nodes: Sequence[str]) -> list[list[int]]:
    """The TP groups (lists of ranks) whose ranks are not all on one node."""
    out = []
    for pp in range(layout.pp):
        for dp in range(layout.dp):
            group = [layout.rank_of(t, pp, dp) for t in range(layout.tp)]
            if len({rank_nodes[r] for r in group}) > 1:
                out.append(group)
    return out


def format_rank_table(rows: Sequence[Mapping]) -> list[str]:
    """Per node, the ranks it holds: 'node0 (10.0.0.10): actor 0-1 [tp0-1 pp0 dp0]; critic 0-1 ...'."""
    by_node: dict[tuple, dict[str, list]] = {}
    for r in rows:
        key = (r["node"], r.get("ip", ""), r.get("node_id", ""))
        by_node.setdefault(key, {}).setdefault(r["role"], []).append(r)
    names = [str(NodeInfo(host, ip)) for host, ip, _ in by_node]
    lines = []
    for ((host, ip, node_id), roles), name in zip(by_node.items(), names):
        if names.count(name) > 1:  # several Ray nodes on one host
            name += f" node {node_id[:8]}"
        parts = [f"{role} {rank_span([r['rank'] for r in rs])} [{_coords(rs)}]" for role, rs in roles.items()]
        lines.append(f"{name}: " + "; ".join(parts))
    return lines


def rank_span(values: Sequence[int]) -> str:
    """Sorted ints as compact ranges: [0, 1, 2, 5] -> '0-2,5'."""
    out, vals = [], sorted(set(values))
    start = prev = None
    for v in vals + [None]:
        if start is None:
            start = prev = v
        elif v is not None and v == prev + 1:
            prev = v
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    return ",".join(out)


def _coords(rows: Sequence[Mapping]) -> str:
    return " ".join(f"{k}{rank_span([r[k] for r in rows])}" for k in ("tp", "pp", "dp"))


def remove_placement(plan: PlacementPlan) -> None:
    """Give the plan's placement groups back to Ray (their actors must be gone or are killed with them)."""
    from ray.util.placement_group import remove_placement_group

    for pool in list(plan.groups):
        remove_placement_group(plan.groups.pop(pool))
    for rp in plan.roles.values():
        rp.pg = None
