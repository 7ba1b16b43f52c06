"""The vLLM engines' GPUs on a real Ray cluster (issue 48 item 1), without a GPU and without starting vLLM: a local
Ray cluster that declares 8 GPUs (Ray assigns CUDA_VISIBLE_DEVICES to GPU actors on a CPU machine too), the
product's placement and RayWorkerGroup with one GPU per rank, and a probe worker whose ranks gather their devices
(rollout/vllm_layout.gather_rank_devices, a collective), plan the engines and build the owner's engine environment.
Checked for a TP2 x DP2 and a PP2 x DP2 actor: each engine's CUDA_VISIBLE_DEVICES is exactly the GPUs Ray gave its
replica's ranks (ray.get_gpu_ids() read by each rank), owned by the replica's representative, with vLLM TP 2.
"""
from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")

from megatron_ppo.distributed import (ClusterSlots, RankLayout, RankResources, RayWorkerGroup,  # noqa: E402
                                      connect_or_start, create_placement, plan_placement, remove_placement)

GPUS = 8  # two actors of 4 ranks side by side, one GPU each


class EngineProbe:
    """What an actor rank would decide before starting its vLLM engine."""

    def engines(self, engine_tp, engine_pp: int) -> dict:
        from dataclasses import asdict

        from megatron_ppo.rollout.vllm_layout import (engine_env, engine_for_rank, gather_rank_devices,
                                                      local_rank_device, plan_engines)

        devices = gather_rank_devices()
        plans = plan_engines(devices, engine_tp, engine_pp)
        me = local_rank_device()
        mine = engine_for_rank(plans, me.rank)
        env = engine_env(mine, os.environ) if mine else None
        return {"rank": me.rank, "ray_gpus": [str(g) for g in ray.get_gpu_ids()],
                "own_env": os.environ.get("CUDA_VISIBLE_DEVICES"), "node": ray.util.get_node_ip_address(),
                "plans": [asdict(p) for p in plans], "mine": asdict(mine) if mine else None,
                "engine_env": None if env is None else env.get("CUDA_VISIBLE_DEVICES")}


@pytest.fixture(scope="module")
def answers():
    """Both layouts' probe answers, from one Ray session (their groups start side by side)."""
    from concurrent.futures import ThreadPoolExecutor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module
    cluster = connect_or_start("local", num_cpus=GPUS, num_gpus=GPUS)
    try:
        with ThreadPoolExecutor(len(LAYOUTS)) as pool:
            return dict(zip(LAYOUTS, pool.map(_probe, LAYOUTS.values())))
    finally:
        cluster.shutdown()


LAYOUTS = {"tp2_dp2": RankLayout(tp=2, pp=1, dp=2), "pp2_dp2": RankLayout(tp=1, pp=2, dp=2)}


def _probe(layout: RankLayout) -> list[dict]:
    plan = plan_placement({"actor": layout}, ClusterSlots(1, layout.world_size, "GPU"), "colocated",
                          RankResources(num_cpus=1, num_gpus=1))
    create_placement(plan, name_prefix=f"vllm_layout_tp{layout.tp}_pp{layout.pp}")
    group = None
    try:
        group = RayWorkerGroup("actor", layout, plan.roles["actor"], EngineProbe, collective_timeout_s=60)
        # rollout.vllm.tensor_model_parallel_size null (the replica's GPUs), pipeline_model_parallel_size 1
        return group.call_all("engines", None, 1)
    finally:
        if group is not None:
            group.shutdown()
        remove_placement(plan)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_engine_sees_exactly_its_replicas_ray_gpus(answers, name):
    layout, answers = LAYOUTS[name], answers[name]
    by_rank = {a["rank"]: a for a in answers}
    assert sorted(by_rank) == list(range(4))
    for a in answers:  # Ray gave every rank its own GPU and set CUDA_VISIBLE_DEVICES to it
        assert len(a["ray_gpus"]) == 1 and a["own_env"] == a["ray_gpus"][0], a
        assert a["plans"] == answers[0]["plans"], "the ranks disagree on the plan"
    assert len({a["own_env"] for a in answers}) == 4
    plans = answers[0]["plans"]
    assert [(p["dp"], p["index"], p["count"]) for p in plans] == [(0, 0, 1), (1, 0, 1)]  # one node: one per replica
    for p in plans:
        replica = tuple(layout.dp_group(p["dp"]))
        want = tuple(by_rank[r]["ray_gpus"][0] for r in replica)  # rank order
        assert p["ranks"] == replica and p["gpus"] == want, p
        assert p["owner"] == layout.representative(p["dp"]), p
        assert (p["tensor_parallel_size"], p["pipeline_parallel_size"]) == (2, 1)
        assert p["node"] == by_rank[p["owner"]]["node"]
        owner = by_rank[p["owner"]]
        assert owner["mine"] == p and owner["engine_env"] == ",".join(want), owner  # the env the engine gets
    for r, a in by_rank.items():
        if r not in layout.representatives:
            assert a["mine"] is None and a["engine_env"] is None, a
