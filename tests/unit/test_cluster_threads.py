"""cluster.num_cpus_per_rank: auto (the default) gives each rank the CPUs it really has: the node's CPUs over the
bundles placed on it. The old rule (a fixed 1) left one rank per role on a 2-core machine at one torch thread."""
from __future__ import annotations

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.trainer.groups import cpus_per_rank, plan

ONE_RANK_PER_ROLE = ["cluster.n_gpus_per_node=1", "cluster.actor.tensor_model_parallel_size=1",
                     "cluster.ref.tensor_model_parallel_size=1"]


def test_auto_is_the_default():
    from megatron_ppo.config.schema import ClusterConfig

    assert ClusterConfig().num_cpus_per_rank == "auto"
    assert load_config("tiny_cpu").cluster.num_cpus_per_rank == "auto"


@pytest.mark.parametrize("node_cpus, overrides, threads", [
    (2, ONE_RANK_PER_ROLE, 2),  # one bundle, shared by actor / critic / ref (they take turns): both cores
    (2, [], 1),  # tiny_cpu: two ranks on two cores
    (64, ONE_RANK_PER_ROLE, 64),
    (64, [], 32),
    (6, ["cluster.placement=split", "cluster.n_gpus_per_node=3", "cluster.actor.data_parallel_size=1",
         "cluster.ref.data_parallel_size=1", "cluster.critic.data_parallel_size=1"] + ONE_RANK_PER_ROLE[1:],
     2),  # split: 3 pools of 1 bundle on one node
    (2, ["cluster.num_cpus_per_rank=1"] + ONE_RANK_PER_ROLE, 1),  # an explicit number wins
    (2, ["cluster.launcher=local"] + ONE_RANK_PER_ROLE, 2),  # every role in this process
])
def test_auto_threads_per_rank(node_cpus, overrides, threads):
    cfg = load_config("tiny_cpu", overrides)
    assert cpus_per_rank(cfg, node_cpus) == threads
    if cfg.cluster.launcher == "ray":
        placed = plan(cfg, node_cpus)
        assert {rp.threads for rp in placed.roles.values()} == {threads}
        assert all(b["CPU"] == threads for bundles in placed.pools.values() for b in bundles)
        per_node = sum(len(bundles) for bundles in placed.pools.values())
        assert per_node * threads <= node_cpus  # the bundles fit the node they were sized from


def test_70b_gpu_config_sizes_bundles_from_the_node():
    cfg = load_config("ppo_70b")
    assert cpus_per_rank(cfg, 96) == 12 and cpus_per_rank(cfg, 4) == 1


def test_default_plan_uses_this_process_cpus(monkeypatch):
    from megatron_ppo.distributed import placement

    monkeypatch.setattr(placement, "local_cpu_count", lambda: 16)
    import megatron_ppo.trainer.groups as groups

    monkeypatch.setattr(groups, "local_cpu_count", lambda: 16)
    assert cpus_per_rank(load_config("tiny_cpu", ONE_RANK_PER_ROLE)) == 16
