"""Which ranks empty their CUDA cache after every call (issue 47, colocated memory): the driver decides it from the
placement it built (trainer/groups.shares_gpu); RankActor.call then runs parallel/device_memory.py's release
(tests/integration/test_distributed_ray.py counts it on real ranks)."""
from __future__ import annotations

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.trainer.groups import plan, shares_gpu

DP2 = [f"cluster.{role}.data_parallel_size=2" for role in ("actor", "critic", "ref")]


def _shared(overrides: list[str], config: str = "gsm8k_7b") -> dict[str, bool]:
    cfg = load_config(config, overrides)
    return {role: shares_gpu(cfg, role, rp) for role, rp in plan(cfg, node_cpus=96).roles.items()}


@pytest.mark.parametrize("overrides, expected", [
    ([], (True, True, True)),  # colocated on GPUs (gsm8k_7b): each role's rank holds a third of a GPU
    (["cluster.placement=split", "cluster.nnodes=3", *DP2], (False, False, False)),  # a whole GPU each
    (["cluster.placement=split", "cluster.n_gpus_per_node=24", "cluster.num_gpus_per_rank=0.5", *DP2],
     (True, True, True)),  # half a GPU: Ray may seat another rank on it
    (["cluster.placement=split", "cluster.nnodes=3", "rollout.name=vllm", *DP2], (True, False, False)),  # + vLLM
    (["cluster.device=cpu"], (False, False, False)),  # no GPU, no CUDA cache
], ids=["colocated", "split", "split-half-gpu", "split-vllm", "cpu"])
def test_ranks_that_share_a_gpu_empty_their_cache(overrides, expected):
    assert _shared(overrides) == dict(zip(("actor", "critic", "ref"), expected))


def test_release_is_harmless_without_cuda():
    from megatron_ppo.parallel.device_memory import release_cached_memory
    from megatron_ppo.parallel.platform import cpu_platform_enabled, disable_cpu_platform, enable_cpu_platform

    was_on = cpu_platform_enabled()
    enable_cpu_platform()
    try:
        assert release_cached_memory() == 0  # the CPU platform layer's no-op (what a rank on CPU runs)
    finally:
        if not was_on:
            disable_cpu_platform()
    if not was_on:
        assert release_cached_memory() == 0  # torch's own empty_cache, CUDA never initialised
