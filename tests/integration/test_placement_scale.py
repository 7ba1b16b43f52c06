"""configs/ppo_70b.yaml's placement at its real scale, simulated (issue 27): a Ray cluster of 16 nodes x 8 GPUs on
this machine (ray.cluster_utils; the GPUs are Ray resources only), the driver's own planning and placement code
(trainer.groups.plan, distributed.placement.create_placement), and a stand-in task per rank of every role in that
rank's share of its bundle, reporting the node it ran on. Checked: every TP group inside one node; pipeline stage k
on its own 4 nodes, stages in Megatron's rank order; colocated roles' rank r on one bundle; no node holds more than
its 8 GPUs; the run's table equals `megatron-ppo plan --placement`'s, node for node. Plus the pure functions on
made-up bundle -> node maps (Ray's PACK numbers bundles in no promised node order)."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from megatron_ppo.distributed.layout import ClusterSlots, RankLayout
from megatron_ppo.distributed.placement import (NodeInfo, format_rank_table, node_ordered_bundles, plan_placement,
                                                rank_span, rank_table, seat_by_node, split_tp_groups)

REPO = Path(__file__).resolve().parents[2]
NODES, GPUS = 16, 8


def test_node_order_seats_tp_groups_inside_nodes_whatever_order_ray_numbers_bundles():
    # 8 bundles on nodes a and b, interleaved as Ray may number them: ranks 0-3 must go to one node
    nodes = ["a", "b", "a", "b", "b", "a", "a", "b"]
    order = node_ordered_bundles(nodes)
    assert order == [0, 2, 5, 6, 1, 3, 4, 7]
    layout = RankLayout(tp=4, pp=1, dp=2)
    assert split_tp_groups(layout, [nodes[b] for b in order]) == []
    assert split_tp_groups(layout, nodes) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # seating by bundle index would split
    plan = plan_placement({"actor": layout, "critic": RankLayout(1, 1, 4)}, ClusterSlots(2, 4))
    for rp in plan.roles.values():
        seat_by_node(rp, [NodeInfo("host", "10.0.0.1", n) for n in nodes])
    assert plan.roles["actor"].bundle_indices == order
    assert plan.roles["critic"].bundle_indices == order[:4]  # colocated: rank r of every role on one bundle
    rows = rank_table({"actor": layout, "critic": RankLayout(1, 1, 4)}, plan)
    lines = format_rank_table(rows)
    assert len(lines) == 2 and "node a" in lines[0] and "actor 0-3 [tp0-3 pp0 dp0]" in lines[0], lines
    assert rank_span([5, 0, 1, 2, 7]) == "0-2,5,7"


def test_plan_placement_of_the_70b_config_fills_nodes_in_megatron_order():
    out = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "plan", "--config", "ppo_70b", "--placement",
                          "--json"], cwd=REPO, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    assert len(rows) == 3 * 128 and set(rows[0]) >= {"role", "rank", "tp", "pp", "dp", "node"}
    for r in rows:  # TP8 x PP4 x DP4: node = rank // 8, stage k on nodes 4k..4k+3
        assert r["node"] == f"node{r['rank'] // 8}" and r["rank"] == r["tp"] + 8 * r["dp"] + 32 * r["pp"], r
    text = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "plan", "--config", "ppo_70b", "--placement"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "node15: actor 120-127 [tp0-7 pp3 dp3]" in text and "every TP group inside one node" in text, text


@pytest.mark.slow
def test_ppo_70b_placement_on_16_simulated_nodes_of_8_gpus():
    import ray
    from ray.cluster_utils import Cluster

    from megatron_ppo.config import load_config
    from megatron_ppo.distributed.placement import create_placement, remove_placement
    from megatron_ppo.trainer.groups import layouts, plan

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": GPUS,
                                                            "include_dashboard": False})
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=1, num_gpus=GPUS)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        cfg = load_config("ppo_70b", ["cluster.num_cpus_per_rank=0.1"])  # the fake nodes have 1 CPU each
        role_layouts = layouts(cfg)
        placement = create_placement(plan(cfg))
        try:
            table = rank_table(role_layouts, placement)

            @ray.remote
            def where() -> str:
                return ray.get_runtime_context().get_node_id()

            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            # in waves of one task per node, asking for no resources of their own (the bundle is reserved; the roles'
            # shares are the plan's, checked below): a node's 24 tasks at once, or each holding a GPU share, would
            # each start a worker process (minutes on 2 cores) instead of reusing one
            waves: dict[tuple, list[int]] = {}
            seen: Counter = Counter()
            for i, r in enumerate(table):
                waves.setdefault((r["role"], seen[(r["role"], r["node_id"])]), []).append(i)
                seen[(r["role"], r["node_id"])] += 1
            ran_on = [""] * len(table)
            for wave in waves.values():
                refs = [where.options(num_cpus=0, num_gpus=0,
                                      scheduling_strategy=PlacementGroupSchedulingStrategy(
                                          placement.roles[table[i]["role"]].pg,
                                          placement_group_bundle_index=table[i]["bundle"])).remote() for i in wave]
                for i, node in zip(wave, ray.get(refs, timeout=120)):
                    ran_on[i] = node
        finally:
            remove_placement(placement)
    finally:
        ray.shutdown()
        cluster.shutdown()

    assert len(table) == 3 * 128
    assert [r["node_id"] for r in table] == ran_on  # the table says where the stand-ins really ran
    node_ids = {r["node_id"] for r in table}
    assert len(node_ids) == NODES
    gpus = Counter()
    for r in table:
        gpus[r["node_id"]] += placement.roles[r["role"]].num_gpus
    assert max(gpus.values()) <= GPUS + 1e-6, gpus  # nobody over-subscribed
    order = list(dict.fromkeys(r["node_id"] for r in table if r["role"] == "actor"))  # nodes in rank order
    for role, layout in role_layouts.items():
        rows = sorted((r for r in table if r["role"] == role), key=lambda r: r["rank"])
        assert split_tp_groups(layout, [r["node_id"] for r in rows]) == [], role
        for r in rows:
            assert (r["tp"], r["pp"], r["dp"]) == tuple(layout.coords(r["rank"])[i] for i in (0, 1, 2))
            # Megatron's order: rank = tp + 8 dp + 32 pp, so node k of the order holds ranks 8k..8k+7 and pipeline
            # stage p sits on nodes 4p..4p+3; the plan's table says the same with node<k>
            assert order.index(r["node_id"]) == r["rank"] // GPUS, (role, r)
    by_rank = {}
    for r in table:
        by_rank.setdefault(r["rank"], set()).add((r["bundle"], r["node_id"]))
    assert all(len(v) == 1 for v in by_rank.values())  # colocated: rank r of every role on one bundle
