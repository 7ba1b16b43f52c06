"""The pure parts of conversion: config -> arch, the QKV / gate-up / vocab transforms, chunk tiling, the ledger."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ppo.convert.hf_io import parse_size
from megatron_ppo.convert.ledger import Ledger
from megatron_ppo.convert.mapping import (
    ConversionError,
    arch_from_hf_config,
    conversion_pieces,
    fuse_qkv,
    hf_tensor_shapes,
    pad_vocab,
    pp_layer_ranges,
    split_qkv,
    to_hf,
    to_mcore,
    unpad_vocab,
    validate_layout,
)
from megatron_ppo.convert.mcore_io import chunk_coverage_problems
from megatron_ppo.models.arch import ModelArch

LLAMA = dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def test_v4_style_config_with_llama3_rope_and_explicit_head_dim():
    arch = arch_from_hf_config({**LLAMA, "rope_theta": 500000.0, "head_dim": 16, "tie_word_embeddings": True,
                                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256}})
    assert arch.rotary_base == 500000.0 and arch.kv_channels == 16 and arch.head_dim == 16
    assert arch.rope_config() == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    assert arch.tie_word_embeddings and not arch.add_qkv_bias and arch.num_query_groups == 2
    assert "lm_head.weight" not in hf_tensor_shapes(arch)


def test_qwen2_defaults_and_refusals():
    arch = arch_from_hf_config({**LLAMA, "model_type": "qwen2"})
    assert arch.add_qkv_bias and arch.kv_channels is None and arch.rope_scaling is None
    with pytest.raises(ConversionError, match="use_sliding_window"):
        arch_from_hf_config({**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64})
    with pytest.raises(ConversionError, match="attention_bias"):
        arch_from_hf_config({**LLAMA, "attention_bias": True})
    with pytest.raises(ConversionError, match="hidden_act"):
        arch_from_hf_config({**LLAMA, "hidden_act": "gelu"})
    with pytest.raises(ConversionError, match="yarn"):
        arch_from_hf_config({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConversionError, match="MistralForCausalLM"):
        arch_from_hf_config({**LLAMA, "architectures": ["MistralForCausalLM"]})


def test_layout_errors_name_the_dimension():
    arch = arch_from_hf_config(LLAMA)
    validate_layout(arch, tp=4, pp=2)
    validate_layout(arch, tp=8, pp=1)  # 2 KV groups split across 8 ranks: megatron allows tp a multiple of ng
    with pytest.raises(ConversionError, match="num_attention_heads=8 is not divisible by tp=3"):
        validate_layout(arch, tp=3, pp=1)
    with pytest.raises(ConversionError, match="num_layers=4 is not divisible by pp=3"):
        validate_layout(arch, tp=1, pp=3)
    assert pp_layer_ranges(4, 2) == [range(0, 2), range(2, 4)]


@settings(max_examples=40, deadline=None)
@given(groups=st.integers(1, 4), per_group=st.integers(1, 4), hn=st.sampled_from([2, 4, 8]), bias=st.booleans())
def test_qkv_fusion_is_megatrons_group_interleave_and_inverts(groups, per_group, hn, bias):
    heads = groups * per_group
    arch = ModelArch(num_layers=1, hidden_size=heads * hn, ffn_hidden_size=8, num_attention_heads=heads,
                     num_query_groups=groups, vocab_size=8, max_position_embeddings=8)
    rest = () if bias else (5,)
    q = torch.randn(heads * hn, *rest)
    k = torch.randn(groups * hn, *rest)
    v = torch.randn(groups * hn, *rest)
    fused = fuse_qkv(q, k, v, arch)
    # megatron views the rows as [ng, np/ng + 2, hn]: per group its q heads, then its k head, then its v head.
    view = fused.reshape(groups, per_group + 2, hn, *rest)
    for g in range(groups):
        for j in range(per_group):
            assert torch.equal(view[g, j], q.reshape(heads, hn, *rest)[g * per_group + j])
        assert torch.equal(view[g, per_group], k.reshape(groups, hn, *rest)[g])
        assert torch.equal(view[g, per_group + 1], v.reshape(groups, hn, *rest)[g])
    for a, b in zip(split_qkv(fused, arch), (q, k, v)):
        assert torch.equal(a, b)


def test_every_map_round_trips_exactly():
    arch = arch_from_hf_config({**LLAMA, "model_type": "qwen2"})
    shapes = hf_tensor_shapes(arch)
    hf = {n: torch.randn(s) for n, s in shapes.items()}
    seen = []
    for piece in conversion_pieces(arch, tp=2):
        for m in piece.maps:
            t = to_mcore(m, hf, arch)
            assert tuple(t.shape) == m.shape
            back, dropped = to_hf(m, t, arch)
            for n, x in back.items():
                assert torch.equal(x, hf[n]), n
                seen.append(n)
            if m.kind == "vocab":
                assert m.shape[0] == 1024 and dropped.shape[0] == 24 and not dropped.any()
    assert sorted(seen) == sorted(shapes)


def test_vocab_padding():
    w = torch.randn(300, 4)
    padded = pad_vocab(w, 384)
    assert padded.shape == (384, 4) and not padded[300:].any()
    kept, dropped = unpad_vocab(padded, 300)
    assert torch.equal(kept, w) and dropped.shape == (84, 4)
    with pytest.raises(ConversionError, match="fewer than the vocab size"):
        unpad_vocab(w, 301)


def test_chunk_tiling_detects_gaps_and_overlaps():
    full = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert chunk_coverage_problems((4, 4), full) is None
    assert "cover 8 of 16" in chunk_coverage_problems((4, 4), full[:1])
    assert "overlap" in chunk_coverage_problems((4, 4), full + [((1, 0), (2, 4))])
    assert "outside" in chunk_coverage_problems((4, 4), [((3, 0), (2, 4))])


def test_ledger_refuses_doubles_and_leftovers():
    ledger = Ledger("t")
    ledger.expect_source("a", 4, "mlp")
    ledger.expect_source("b", 4, "mlp")
    ledger.expect_target("ab", 8, "mlp")
    ledger.consume("a")
    with pytest.raises(ConversionError, match="consumed twice"):
        ledger.consume("a")
    ledger.write("ab", 8)
    with pytest.raises(ConversionError, match="written twice"):
        ledger.write("ab", 8)
    with pytest.raises(ConversionError, match="never consumed: \\['b'\\]"):
        ledger.check()
    ledger.consume("b")
    ledger.check()
    with pytest.raises(ConversionError, match="not an expected source"):
        ledger.consume("c")


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1GiB") == 2**30 and parse_size("500MB") == 5 * 10**8
    assert parse_size(123) == 123 and parse_size("40KB") == 40_000
