"""rollout/vllm_layout.py: which vLLM engines the actor's replicas get, over which GPUs, owned by which rank; what
preflight refuses from the config alone. Pure (made-up rank devices in megatron's rank order); the Ray-assigned
devices are tests/integration/test_vllm_layout_ray.py."""
from __future__ import annotations

import re

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.distributed.layout import RankLayout
from megatron_ppo.errors import UsageError
from megatron_ppo.rollout.vllm_layout import (EnginePlacement, RankDevice, engine_env, engine_for_rank, plan_engines,
                                              rank_gpus, rows_of)
from megatron_ppo.trainer.vllm_preflight import check_engine_layout


def devices(layout: RankLayout, per_node: int, gpus_per_rank: float = 1.0, cpu: bool = False,
            node=lambda n: f"10.0.0.{n + 1}") -> list[RankDevice]:
    """The ranks of ``layout`` seated in rank order, ``per_node`` a node, each with ``gpus_per_rank`` GPUs (a
    fraction: ranks packed onto shared GPUs), named per node as CUDA_VISIBLE_DEVICES would."""
    out = []
    for r in range(layout.world_size):
        c, slot = layout.coords(r), r % per_node
        if cpu:
            gpus = ()
        elif gpus_per_rank >= 1:
            gpus = tuple(str(slot * int(gpus_per_rank) + k) for k in range(int(gpus_per_rank)))
        else:
            gpus = (str(int(slot * gpus_per_rank)),)
        out.append(RankDevice(r, c.tp, c.pp, c.dp, node(r // per_node), gpus))
    return out


def test_tp2_dp2_on_one_node_one_engine_per_replica_over_its_two_gpus():
    layout = RankLayout(tp=2, dp=2)
    plans = plan_engines(devices(layout, 4), None, 1)
    assert plans == [EnginePlacement(0, 0, 1, "10.0.0.1", 0, (0, 1), ("0", "1"), 2, 1),
                     EnginePlacement(1, 0, 1, "10.0.0.1", 2, (2, 3), ("2", "3"), 2, 1)]
    assert [p.owner for p in plans] == layout.representatives
    assert plans[1].cuda_visible_devices == "2,3"
    assert plan_engines(devices(layout, 4), 2, 1) == plans  # the key set to what null resolves to
    assert engine_for_rank(plans, 2) is plans[1] and engine_for_rank(plans, 1) is None


def test_pp2_dp2_on_one_node_the_engine_takes_both_stages_gpus_and_the_last_stage_owns_it():
    layout = RankLayout(tp=1, pp=2, dp=2)  # dp0: ranks 0 (pp0), 2 (pp1); dp1: ranks 1, 3
    plans = plan_engines(devices(layout, 4), None, 1)
    assert [(p.dp, p.ranks, p.gpus, p.owner, p.tensor_parallel_size) for p in plans] == [
        (0, (0, 2), ("0", "2"), 2, 2), (1, (1, 3), ("1", "3"), 3, 2)]
    assert [p.owner for p in plans] == layout.representatives
    pp = plan_engines(devices(layout, 4), None, 2)  # vLLM's own pipeline over the two GPUs
    assert [(p.tensor_parallel_size, p.pipeline_parallel_size, p.gpus) for p in pp] == [(1, 2, ("0", "2")),
                                                                                        (1, 2, ("1", "3"))]


def test_ppo_70b_tp8_pp4_dp4_on_16_nodes_four_tp8_engines_per_replica_owned_by_each_stages_tp0():
    layout = RankLayout(tp=8, pp=4, dp=4)
    plans = plan_engines(devices(layout, 8), None, 1)
    assert len(plans) == 16
    for dp in range(4):
        mine = [p for p in plans if p.dp == dp]
        assert [(p.index, p.count) for p in mine] == [(i, 4) for i in range(4)]
        assert [p.owner for p in mine] == [layout.rank_of(0, pp, dp) for pp in range(4)]  # ordered by stage
        assert mine[-1].owner == layout.representative(dp)  # the representative owns its node's engine
        for pp, p in enumerate(mine):
            assert p.ranks == tuple(layout.rank_of(t, pp, dp) for t in range(8))
            assert p.gpus == tuple(str(g) for g in range(8)) and p.tensor_parallel_size == 8
            assert p.node == f"10.0.0.{p.owner // 8 + 1}"
    assert len({p.node for p in plans}) == 16  # one engine per node
    with pytest.raises(UsageError, match=re.escape(
            "rollout.vllm.tensor_model_parallel_size (32) x pipeline_model_parallel_size (1) = 32 GPUs per engine, "
            "but actor replica dp0 holds 8 GPUs on node 10.0.0.1 (ranks 0-7)")):
        plan_engines(devices(layout, 8), 32, 1)  # an engine never spans nodes


def test_colocated_ranks_sharing_a_gpu_count_it_once_and_a_rank_with_two_gpus_gives_both():
    shared = devices(RankLayout(tp=2, dp=2), 4, gpus_per_rank=0.5)  # ranks 0, 1 on GPU 0; 2, 3 on GPU 1
    assert [(p.gpus, p.tensor_parallel_size) for p in plan_engines(shared, None, 1)] == [(("0",), 1), (("1",), 1)]
    with pytest.raises(UsageError, match=re.escape("= 2 GPUs per engine, but actor replica dp0 holds 1 GPUs on "
                                                   "node 10.0.0.1 (ranks 0-1)")):
        plan_engines(shared, 2, 1)
    double = devices(RankLayout(tp=2, dp=1), 2, gpus_per_rank=2)
    assert [(p.gpus, p.tensor_parallel_size) for p in plan_engines(double, None, 1)] == [(("0", "1", "2", "3"), 4)]


def test_cpu_one_engine_per_replica_on_its_representative_whatever_the_nodes():
    layout = RankLayout(tp=2, pp=2, dp=2)
    cpu = devices(layout, 2, cpu=True)  # every TP group on its own node: a replica spans 2 nodes
    plans = plan_engines(cpu, None, 1)
    assert [(p.dp, p.index, p.count, p.owner, p.node, p.ranks, p.gpus, p.tensor_parallel_size,
             p.pipeline_parallel_size) for p in plans] == [
        (0, 0, 1, 4, "10.0.0.3", (0, 1, 4, 5), (), 1, 1), (1, 0, 1, 6, "10.0.0.4", (2, 3, 6, 7), (), 1, 1)]
    assert plans[0].cuda_visible_devices is None
    assert [p.tensor_parallel_size for p in plan_engines(cpu, 3, 1)] == [3, 3]  # CPU: vLLM's TP unconstrained
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": ""}
    assert engine_env(plans[0], base) == base  # a rank without a GPU does not hand the host's GPUs to its engine


def test_engine_env_names_the_engines_gpus_and_leaves_the_base_alone():
    plan = plan_engines(devices(RankLayout(tp=1, pp=2, dp=1), 2), None, 1)[0]
    base = {"CUDA_VISIBLE_DEVICES": "1", "HOME": "/root"}  # the owner's own: its one GPU
    assert engine_env(plan, base) == {"CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root"}
    assert base["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("devs, tp, pp, says", [
    (devices(RankLayout(tp=2, dp=2), 4), 4, 1,
     "rollout.vllm.tensor_model_parallel_size (4) x pipeline_model_parallel_size (1) = 4 GPUs per engine, but actor "
     "replica dp0 holds 2 GPUs on node 10.0.0.1 (ranks 0-1); one vLLM engine per node of an actor replica takes the "
     "replica's GPUs there: set tensor_model_parallel_size to 2, or null"),
    (devices(RankLayout(tp=3, dp=1), 3), 2, 2,
     "(2) x pipeline_model_parallel_size (2) = 4 GPUs per engine, but actor replica dp0 holds 3 GPUs on node "
     "10.0.0.1 (ranks 0-2); one vLLM engine per node of an actor replica takes the replica's GPUs there: set "
     "pipeline_model_parallel_size to a divisor of 3 and tensor_model_parallel_size to null"),
    (devices(RankLayout(tp=3, dp=1), 3), None, 2,
     "rollout.vllm.pipeline_model_parallel_size (2) does not divide an engine's GPUs: actor replica dp0 holds 3 GPUs "
     "on node 10.0.0.1 (ranks 0-2), and with tensor_model_parallel_size null an engine takes them all: set "
     "pipeline_model_parallel_size to a divisor of 3"),
    (devices(RankLayout(tp=4, dp=1), 2), None, 1,
     "actor replica dp0 has ranks 2-3 on node 10.0.0.2 but none with tp=0 (a TP group spans nodes): no rank there "
     "can own a vLLM engine; make cluster.n_gpus_per_node a multiple of cluster.actor.tensor_model_parallel_size"),
    (devices(RankLayout(tp=2), 2)[:1] + devices(RankLayout(tp=2), 2, cpu=True)[1:], None, 1,
     "actor ranks 0 hold GPUs but ranks 1 none"),
    (devices(RankLayout(tp=2), 2) * 2, None, 1, "plan_engines: ranks [0, 0, 1, 1] repeat"),
    ([], None, 1, "plan_engines: no actor ranks"),
], ids=["tp_not_the_gpus", "tp_pp_not_the_gpus", "pp_not_dividing", "no_owner_on_a_node", "mixed", "repeat", "empty"])
def test_refusals_name_the_keys_and_the_numbers(devs, tp, pp, says):
    with pytest.raises(UsageError, match=re.escape(says)):
        plan_engines(devs, tp, pp)


def test_rows_of_splits_a_replicas_prompts_contiguously_and_evenly():
    for n in range(0, 11):
        for count in range(1, 5):
            parts = [rows_of(n, i, count) for i in range(count)]
            assert [r for s in parts for r in range(n)[s]] == list(range(n))
            sizes = [s.stop - s.start for s in parts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    for bad in ((4, 2, 2), (4, -1, 2), (4, 0, 0), (-1, 0, 1)):
        with pytest.raises(ValueError):
            rows_of(*bad)


def test_rank_gpus_under_ray_torchrun_and_cpu():
    assert rank_gpus({"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": "0"}, True, False) == ("3", "5")  # Ray: all
    assert rank_gpus({"CUDA_VISIBLE_DEVICES": ""}, True, True) == ()
    assert rank_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_RANK": "1"}, False, True) == ("5",)  # torchrun
    assert rank_gpus({"LOCAL_RANK": "2"}, False, True) == ("2",)
    assert rank_gpus({}, False, True) == ("0",)
    assert rank_gpus({"LOCAL_RANK": "2"}, False, False) == ()  # CPU
    assert rank_gpus({"CUDA_VISIBLE_DEVICES": ""}, False, True) == ()
    with pytest.raises(UsageError, match="LOCAL_RANK=2 but CUDA_VISIBLE_DEVICES=0,1 shows 2 GPU"):
        rank_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "2"}, False, True)


# ------------------------------------------------------------------------------------------------ preflight

VLLM_70B = ["rollout.name=vllm", "rollout.n=1", "rollout.vllm.weight_transport=file"]


def test_preflight_ppo_70b_with_vllm_needs_a_shared_weights_dir_and_tp8_engines():
    with pytest.raises(UsageError, match=re.escape(
            "rollout.vllm.weights_dir: actor replicas span 4 nodes (TP x PP = 32 ranks a replica, 8 GPUs per node; "
            "replica dp0: ranks 0-7 on node0, ranks 32-39 on node4, ranks 64-71 on node8, ranks 96-103 on node12); "
            "weight_transport=file needs a directory every node of a replica shares (the default /dev/shm is each "
            "node's own): set a shared file system path, or weight_transport=ipc")):
        check_engine_layout(load_config("ppo_70b", VLLM_70B))
    check_engine_layout(load_config("ppo_70b", VLLM_70B + ["rollout.vllm.weights_dir=/shared/weights"]))
    check_engine_layout(load_config("ppo_70b", VLLM_70B + ["rollout.vllm.weight_transport=ipc"]))  # not this rule
    check_engine_layout(load_config("ppo_70b", VLLM_70B + ["rollout.vllm.weights_dir=/shared/weights",
                                                           "rollout.vllm.tensor_model_parallel_size=8"]))
    with pytest.raises(UsageError, match=re.escape(
            "rollout.vllm.tensor_model_parallel_size (4) x pipeline_model_parallel_size (1) = 4 GPUs per engine, but "
            "actor replica dp0 holds 8 GPUs on node0 (ranks 0-7)")):
        check_engine_layout(load_config("ppo_70b", VLLM_70B + ["rollout.vllm.tensor_model_parallel_size=4"]))


def test_preflight_tiny_on_gpus_cpu_and_colocated_fractions():
    tiny = ["rollout.name=vllm", "rollout.vllm.tensor_model_parallel_size=1"]  # its actor: TP2 on 2 ranks
    check_engine_layout(load_config("tiny_cpu", tiny))  # cluster.device=cpu: vLLM's TP is free
    with pytest.raises(UsageError, match=re.escape("(1) x pipeline_model_parallel_size (1) = 1 GPUs per engine, "
                                                   "but actor replica dp0 holds 2 GPUs on node0 (ranks 0-1)")):
        check_engine_layout(load_config("tiny_cpu", tiny + ["cluster.device=cuda"]))
    check_engine_layout(load_config("tiny_cpu", ["rollout.name=vllm", "cluster.device=cuda"]))  # null: TP2
    half = load_config("tiny_cpu", tiny + ["cluster.device=cuda", "cluster.num_gpus_per_rank=0.5"])
    check_engine_layout(half)  # both actor ranks on one GPU: an engine of TP1
    with pytest.raises(UsageError, match=re.escape("actor replicas span 2 nodes (TP x PP = 2 ranks a replica, 1 "
                                                   "ranks per node; replica dp0: ranks 0 on node0, ranks 1 on node1)")):
        check_engine_layout(load_config("tiny_cpu", ["rollout.name=vllm", "cluster.nnodes=2",
                                                     "cluster.n_gpus_per_node=1",
                                                     "rollout.vllm.weight_transport=file"]))  # CPU too: files per node


def test_run_preflight_refuses_the_engine_layout_before_probing_the_vllm_venv(tmp_path):
    from megatron_ppo.trainer.preflight import PreflightError, run_preflight

    cfg = load_config("tiny_cpu", ["rollout.name=vllm", "rollout.vllm.tensor_model_parallel_size=1",
                                   "cluster.device=cuda", f"trainer.log_dir={tmp_path}/logs",
                                   f"rollout.vllm.python={tmp_path}/no/python"])
    with pytest.raises(PreflightError, match=re.escape("rollout.vllm.tensor_model_parallel_size (1)")):
        run_preflight(cfg)
