"""What a vLLM engine starts with (rollout/vllm_settings.py): GPU defaults (CUDA graphs, prefix caching when
rollout.n > 1, one seed per engine, sleep mode) and the CPU's (eager, no prefix caching, a seed per request, no
sleep); explicit keys win; gpu_memory_utilization lowered to what is free, refused with the numbers when the
weights and one sequence's KV cache do not fit."""
from __future__ import annotations

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.errors import UsageError
from megatron_ppo.rollout.vllm_settings import engine_options, kv_bytes_per_token, memory_fraction

GIB = 1 << 30


def _cfg(*overrides):
    return load_config("tiny_cpu", ["rollout.name=vllm", *overrides])


@pytest.mark.parametrize("on_gpu,n,want", [
    (True, 1, dict(enforce_eager=False, enable_prefix_caching=False, seed_per_request=False, sleep_level=1)),
    (True, 4, dict(enforce_eager=False, enable_prefix_caching=True, seed_per_request=False, sleep_level=1)),
    (False, 4, dict(enforce_eager=True, enable_prefix_caching=False, seed_per_request=True, sleep_level=None)),
])
def test_defaults_follow_the_device_and_rollout_n(on_gpu, n, want):
    got = engine_options(_cfg(f"rollout.n={n}"), on_gpu)
    assert got.__dict__ == want


def test_explicit_keys_win_over_the_device_defaults():
    cfg = _cfg("rollout.vllm.enforce_eager=true", "rollout.vllm.enable_prefix_caching=false",
               "rollout.vllm.free_cache_engine=false", "rollout.n=4")
    got = engine_options(cfg, on_gpu=True)
    assert (got.enforce_eager, got.enable_prefix_caching, got.sleep_level) == (True, False, None)
    assert engine_options(_cfg("rollout.vllm.enable_prefix_caching=true"), on_gpu=False).enable_prefix_caching


def test_kv_bytes_per_token_by_hand():
    from megatron_ppo.models.arch import ModelArch

    arch = ModelArch(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                     num_query_groups=8, vocab_size=128256, max_position_embeddings=8192)  # Llama-3-70B
    assert kv_bytes_per_token(arch, 2) == 2 * 80 * 8 * 128 * 2


def test_memory_fraction_is_the_cap_or_what_is_free():
    total = 80 * GIB
    assert memory_fraction(70 * GIB, total, 0.5, 10 * GIB, GIB, GIB, "dp0") == 0.5
    got = memory_fraction(30 * GIB, total, 0.5, 10 * GIB, GIB, GIB, "dp0")
    assert got == pytest.approx(29 / 80)  # free less the reserve: vLLM V1 refuses util x total above free


def test_memory_fraction_refuses_with_the_numbers():
    with pytest.raises(UsageError, match=r"needs 14.0 GiB per GPU \(weights 12.0 \+ one max_model_len sequence's KV "
                                         r"cache 1.00 \+ reserve 1.0\), but 10.0 of 80.0 GiB are free"):
        memory_fraction(10 * GIB, 80 * GIB, 0.9, 12 * GIB, GIB, GIB, "0 of actor replica dp0")
