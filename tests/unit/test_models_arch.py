"""ModelArch: validation with named errors, Megatron vocab padding, rope scaling normalisation."""
from __future__ import annotations

import pytest

from megatron_ppo.models.arch import ModelArch, tiny_arch


def test_padded_vocab_size_follows_megatron():
    arch = tiny_arch(vocab_size=151665)
    assert arch.padded_vocab_size(1) == 151680  # multiple of 128
    assert arch.padded_vocab_size(2) == 151808  # multiple of 256
    assert arch.padded_vocab_size(8) % (128 * 8) == 0 and arch.padded_vocab_size(8) >= 151665
    assert tiny_arch(vocab_size=512).padded_vocab_size(4) == 512
    with pytest.raises(ValueError, match="tp"):
        arch.padded_vocab_size(0)


@pytest.mark.parametrize("field,value,match", [
    ("num_query_groups", 3, "num_query_groups"),
    ("hidden_size", 0, "hidden_size"),
    ("normalization", "BatchNorm", "normalization"),
    ("activation", "relu2", "activation"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
    ("rope_scaling", {"rope_type": "linear"}, "factor"),
    ("norm_epsilon", 0.0, "norm_epsilon"),
])
def test_invalid_arch_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        tiny_arch(**{field: value})


def test_rope_config_normalises_hf_styles():
    assert tiny_arch().rope_config() == {"rope_type": "default"}
    assert tiny_arch(rope_scaling={"type": "linear", "factor": 2}).rope_config() == {"rope_type": "linear",
                                                                                    "factor": 2.0}
    llama3 = tiny_arch(rope_scaling={"rope_type": "llama3", "factor": 8.0}).rope_config()
    assert llama3 == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}


def test_dict_round_trip_and_unknown_keys():
    arch = tiny_arch(add_qkv_bias=True, tie_word_embeddings=True, kv_channels=32)
    assert ModelArch.from_dict(arch.to_dict()) == arch
    assert arch.head_dim == 32
    with pytest.raises(ValueError, match="unknown keys"):
        ModelArch.from_dict({**arch.to_dict(), "sliding_window": 4096})


def test_num_parameters_counts_a_known_model():
    # SmolLM2-135M: 30 layers, hidden 576, ffn 1536, 9 heads / 3 kv groups, vocab 49152, tied: 134,515,008 params
    arch = ModelArch(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9, num_query_groups=3,
                     vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    assert arch.num_parameters() == 134_515_008
