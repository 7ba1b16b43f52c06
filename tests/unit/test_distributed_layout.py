"""RankLayout numbering equals megatron-core's own rank generator; layouts that do not fit are refused with the
arithmetic before any process starts; placement plans (colocated / split) and the per-replica sampling seed."""
from __future__ import annotations

import inspect
import itertools

import pytest

from megatron_ppo.distributed.layout import ClusterSlots, LayoutError, RankLayout, check_fits, dp_seed
from megatron_ppo.distributed.placement import RankResources, plan_placement

LAYOUTS = [RankLayout(tp, pp, dp) for tp, pp, dp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3))]


def _megatron_coords(layout: RankLayout) -> dict[int, tuple[int, int, int]]:
    """rank -> (tp, pp, dp) from megatron's RankGenerator with the order initialize_model_parallel defaults to."""
    from megatron.core import parallel_state

    order = inspect.signature(parallel_state.initialize_model_parallel).parameters["order"].default
    gen = parallel_state.RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=1, order=order)
    pos = {}
    for token in ("tp", "pp", "dp"):
        for group in gen.get_ranks(token):
            for index, rank in enumerate(group):
                pos.setdefault(rank, {})[token] = index
    return {rank: (p["tp"], p["pp"], p["dp"]) for rank, p in pos.items()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_coords_follow_megatron_rank_generator(layout):
    expected = _megatron_coords(layout)
    assert sorted(expected) == list(range(layout.world_size))
    for rank in range(layout.world_size):
        assert tuple(layout.coords(rank)) == expected[rank], rank
        assert layout.rank_of(*layout.coords(rank)) == rank


def test_dp_groups_and_representatives():
    layout = RankLayout(tp=2, pp=2, dp=2)  # ranks: tp fastest, then dp, then pp
    assert [str(layout.coords(r)) for r in range(8)] == [
        "tp0 pp0 dp0", "tp1 pp0 dp0", "tp0 pp0 dp1", "tp1 pp0 dp1",
        "tp0 pp1 dp0", "tp1 pp1 dp0", "tp0 pp1 dp1", "tp1 pp1 dp1"]
    assert layout.dp_group(0) == [0, 1, 4, 5] and layout.dp_group(1) == [2, 3, 6, 7]
    assert layout.representatives == [4, 6]  # tp0 on the last stage
    assert RankLayout(tp=2, pp=1, dp=3).representatives == [0, 2, 4]


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(LayoutError, match="RankLayout.tp must be a positive int"):
        RankLayout(tp=0)
    with pytest.raises(LayoutError, match=r"actor: 6 ranks do not divide into TP=4 x PP=1 = 4"):
        RankLayout.for_world(4, 1, 6, role="actor")
    assert RankLayout.for_world(2, 2, 8) == RankLayout(2, 2, 2)
    with pytest.raises(LayoutError, match="rank 4 outside a world of 4"):
        RankLayout(2, 1, 2).coords(4)


def test_layout_that_does_not_fit_is_refused_with_the_arithmetic():
    slots = ClusterSlots(nnodes=1, per_node=2, kind="CPU")
    with pytest.raises(LayoutError) as err:
        check_fits({"actor": RankLayout(tp=4), "critic": RankLayout()}, slots)
    assert ("actor TP=4 x PP=1 x DP=1 = 4 ranks but the cluster offers 2 CPU slots "
            "(cluster.nnodes x cluster.n_gpus_per_node = 1 x 2)") in str(err.value)
    check_fits({"actor": RankLayout(tp=2), "critic": RankLayout(dp=2)}, slots)  # colocated: each fits alone
    with pytest.raises(LayoutError, match=r"split placement needs actor 2 \+ critic 2 = 4 ranks but the cluster "
                                          r"offers 2 CPU slots"):
        check_fits({"actor": RankLayout(tp=2), "critic": RankLayout(dp=2)}, slots, "split")
    with pytest.raises(LayoutError, match="placement='spread'"):
        check_fits({"actor": RankLayout()}, slots, "spread")
    with pytest.raises(LayoutError, match="4 ranks but the cluster offers 2 CPU slots"):
        plan_placement({"actor": RankLayout(dp=4)}, slots)  # the plan checks before any placement group exists


def test_colocated_plan_shares_bundles_with_fractional_reservations():
    layouts = {"actor": RankLayout(tp=2), "critic": RankLayout(dp=2), "ref": RankLayout()}
    plan = plan_placement(layouts, ClusterSlots(1, 2, "CPU"), "colocated", RankResources(num_cpus=1))
    assert plan.pools == {"colocated": [{"CPU": 1}, {"CPU": 1}]}
    assert {role: rp.bundle_indices for role, rp in plan.roles.items()} == {
        "actor": [0, 1], "critic": [0, 1], "ref": [0]}
    assert all(rp.num_cpus == 0.3333 and rp.threads == 1 and rp.pool == "colocated" for rp in plan.roles.values())
    assert 3 * 0.3333 <= 1  # the three roles' reservations fit one bundle
    gpu = plan_placement(layouts, ClusterSlots(1, 8), "colocated", RankResources(num_cpus=8, num_gpus=1))
    assert {(rp.num_cpus, rp.num_gpus, rp.threads) for rp in gpu.roles.values()} == {(2.0, 0.3333, 8)}  # Ray: >1 whole


def test_split_plan_gives_each_role_its_own_pool():
    plan = plan_placement({"actor": RankLayout(tp=2), "critic": RankLayout()}, ClusterSlots(1, 4, "CPU"), "split",
                          RankResources(num_cpus=2))
    assert plan.pools == {"actor": [{"CPU": 2}] * 2, "critic": [{"CPU": 2}]}
    assert plan.roles["actor"].num_cpus == 2 and plan.roles["actor"].threads == 2


def test_dp_seed_rule():
    assert [dp_seed(42, d) for d in range(3)] == [42, 1042, 2042]
    seeds = {dp_seed(7 + 1000 * 4 * step, d) for step in range(50) for d in range(4)}
    assert len(seeds) == 200  # the documented per-step derivation never collides
    with pytest.raises(LayoutError):
        dp_seed(1, -1)


def test_auto_cpus_per_rank_is_the_node_over_its_bundles():
    from megatron_ppo.distributed.placement import auto_cpus_per_rank, bundles_per_node

    assert auto_cpus_per_rank(2, 1) == 2 and auto_cpus_per_rank(2, 2) == 1 and auto_cpus_per_rank(64, 8) == 8
    assert auto_cpus_per_rank(2, 3) == 1 and auto_cpus_per_rank(10, 4) == 2  # at least 1, whole CPUs
    with pytest.raises(LayoutError):
        auto_cpus_per_rank(0, 1)
    one = {"actor": RankLayout(), "critic": RankLayout(), "ref": RankLayout()}
    assert bundles_per_node(one, ClusterSlots(1, 8), "colocated") == 1  # the roles share one bundle
    assert bundles_per_node(one, ClusterSlots(1, 8), "split") == 3
    big = {"actor": RankLayout(tp=8, pp=4, dp=4), "critic": RankLayout(tp=8, pp=2, dp=8)}
    assert bundles_per_node(big, ClusterSlots(16, 8), "colocated") == 8  # 128 bundles, 8 a node
