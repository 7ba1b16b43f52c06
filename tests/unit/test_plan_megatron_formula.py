"""The planner's memory model against Megatron-LM's own theoretical memory formula
(megatron/training/theoretical_memory_usage.py, rewritten in megatron_ppo/plan/megatron_reference.py).

Where the two model the same thing they must agree: weights + gradients + optimizer within 0.01 % (only the final
norm's placement differs), and the activations with sequence parallelism + selective recompute exactly once the
documented terms are added (dropout masks, full-width K/V, GeLU vs SwiGLU, embedding, output layer). Where they
intentionally differ (full recompute, SP without selective recompute, logits at PP > 1) the test pins the direction
and the reason, so a change on either side shows up here and in docs/bench/scaling.md."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan import megatron_reference as M
from megatron_ppo.plan.memory import Layout, Workload, layer_activation_bytes, memory

LLAMA3_70B = ModelArch(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=8192)
LLAMA31_8B = ModelArch(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                       num_query_groups=8, vocab_size=128256, max_position_embeddings=8192)
QWEN3_32B = ModelArch(num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64,
                      num_query_groups=8, vocab_size=151936, max_position_embeddings=40960, kv_channels=128)
TIED = ModelArch(num_layers=8, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=4,
                 vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=True)

# (arch, layout, seq, micro-batch, micro-batches per optimizer step)
CASES = [
    (LLAMA3_70B, Layout(8, 4, 4, True, True, "selective"), 1024, 8, 4),  # configs/ppo_70b.yaml, selective
    (LLAMA3_70B, Layout(8, 4, 4, True, True, "selective"), 1024, 8, 2),  # fewer micro-batches than stages
    (LLAMA31_8B, Layout(2, 1, 4, True, True, "selective"), 4096, 1, 8),
    (QWEN3_32B, Layout(8, 2, 2, True, True, "selective"), 4096, 1, 8),
    (QWEN3_32B, Layout(4, 4, 2, True, False, "selective"), 4096, 2, 16),  # replicated optimizer: 18 bytes
    (TIED, Layout(2, 2, 2, True, True, "selective"), 2048, 2, 4),
    (TIED, Layout(4, 1, 1, True, True, "selective"), 2048, 1, 1),
]


def _both(arch, layout, seq, micro, m):
    mem = memory(arch, "actor", layout, Workload(seq_len=seq, micro_batch=micro, micro_batches=m))
    rep = M.report_theoretical_memory(M.megatron_args(arch, layout, seq, micro), m)
    return mem, rep


@pytest.mark.parametrize("arch, layout, seq, micro, m", CASES)
def test_weights_grads_optimizer_agree(arch, layout, seq, micro, m):
    """6 + 12/DP (or 18) bytes per parameter of the most loaded stage on both sides; the final norm (h
    parameters) is the only difference."""
    mem, rep = _both(arch, layout, seq, micro, m)
    assert mem.resident == pytest.approx(rep["weight_and_optimizer"], rel=1e-4)
    bytes_per_param = 6 + 12 / layout.dp if layout.distributed_optimizer else 18
    assert abs(mem.resident - rep["weight_and_optimizer"]) <= 2 * arch.hidden_size * bytes_per_param


@pytest.mark.parametrize("arch, layout, seq, micro, m", CASES)
def test_sp_selective_activations_agree_up_to_the_documented_terms(arch, layout, seq, micro, m):
    mem, rep = _both(arch, layout, seq, micro, m)
    assert rep["branch"] == "sp+selective"
    in_flight = min(layout.pp, m)
    delta = M.documented_activation_delta(arch, seq, micro, layout, in_flight)
    assert mem.activations + delta == pytest.approx(rep["activation"], rel=1e-9)


def test_the_documented_per_layer_terms_by_hand():
    """One layer, SP, TP t: Megatron sbh(18 + 4f/h)/t; the planner 2sb(4h + 2h + 2hg/a + 3f)/t; the difference is
    +2sbh dropout masks, +4sbh(1 - g/a) full-width K/V, -2sbf SwiGLU's third tensor."""
    s, b, t = 1024, 2, 4
    for arch in (LLAMA3_70B, LLAMA31_8B, QWEN3_32B):
        h, f, g, a = arch.hidden_size, arch.ffn_hidden_size, arch.num_query_groups, arch.num_attention_heads
        ours = layer_activation_bytes(arch, s, b, t, True, 2, "selective", True)
        megatron = s * b * h * (18 + 4 * f / h) / t
        assert ours == pytest.approx(2 * s * b * (6 * h + 2 * h * g / a + 3 * f) / t, abs=1)
        assert megatron - ours == pytest.approx(s * b * (2 * h + 4 * h * (1 - g / a) - 2 * f) / t, abs=1)


def test_reference_reproduces_korthikanti_table_2():
    """The rewrite against the paper: GPT (f = 4h), SP + selective: 34 sbh/t per layer; TP without SP (Megatron's
    other branch): sbh(10 + 24/t), x 1.05 temporaries."""
    gpt = ModelArch(num_layers=1, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                    num_query_groups=16, vocab_size=128, max_position_embeddings=2048, activation="gelu")
    s, b, t = 2048, 1, 4
    args = M.megatron_args(gpt, Layout(t, 2, 1, True, True, "selective"), s, b)  # PP2: no output-layer term
    embedding = 8 * s * b * 2 + s * b * 1024 * 2
    assert M.compute_activation_memory(args, 2) == pytest.approx((34 * s * b * 1024 + embedding) / t)
    assert M.compute_activation_memory_without_sp(args, 2) == pytest.approx(
        (s * b * 1024 * (10 + 24 / t) + embedding) * 1.05)
    # 18 bytes per parameter without the distributed optimizer: at PP1 untied, (12 h^2 (MHA + GeLU MLP) + 2 h V
    # (embedding and LM head, V padded to 128 t)) / t + 3 h of norms
    rep = M.compute_weight_and_optimizer_memory(dataclasses.replace(args, use_distributed_optimizer=False,
                                                                    pipeline_model_parallel_size=1))
    assert rep == pytest.approx(18 * ((12 * 1024 ** 2 + 2 * 1024 * 128 * t) / t + 3 * 1024))


def test_intentional_differences_point_the_documented_way():
    """Full recompute: Megatron's formula has none (its no-SP branch, every layer's activations): far above the
    planner's layer inputs. SP without selective recompute: Megatron's no-SP branch leaves its 10 sbh per layer
    undivided by TP, above the planner. Logits at PP > 1: Megatron counts none on its (first) stage, the planner
    counts the last stage's s b V/t x (2 + 4) bytes."""
    full = Layout(8, 4, 4, True, True, "full")
    mem, rep = _both(LLAMA3_70B, full, 1024, 8, 4)
    assert rep["branch"] == "without_sp" and rep["activation"] > 20 * mem.activations
    assert mem.activations < mem.activations_no_recompute
    none_sp = Layout(4, 4, 2, True, True, "none")
    mem, rep = _both(QWEN3_32B, none_sp, 4096, 1, 256)
    assert rep["branch"] == "without_sp" and rep["activation"] > 1.3 * mem.activations
    assert mem.logits == 4096 * QWEN3_32B.padded_vocab_size(4) // 4 * (2 + 4)
    args = M.megatron_args(QWEN3_32B, none_sp, 4096, 1)
    pp1 = dataclasses.replace(args, pipeline_model_parallel_size=1)
    # the output layer (logits + final norm output, bf16) is Megatron's only at PP = 1: the rest is the same
    layers = (4096 * 5120 * (10 + 24 / 4) * 64 + 8 * 4096 + 4096 * 5120) * 1.05
    assert M.compute_activation_memory_without_sp(pp1, 1) == pytest.approx(
        layers + (4096 * QWEN3_32B.padded_vocab_size(4) / 4 + 4096 * 5120) * 2 * 1.05)
