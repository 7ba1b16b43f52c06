"""models/fusions.py: megatron's fused kernels on where their library is (a GPU; TE for RoPE; apex for the wgrad
accumulation), off on the CPU, and never a fusion megatron's MLP would refuse for the activation."""
from __future__ import annotations

import pytest

from megatron_ppo.models.fusions import FUSION_KEYS, activation_fusable, fusion_settings


def test_cpu_keeps_every_fusion_off():
    for impl in ("local", "transformer_engine"):
        assert fusion_settings(impl, False, "swiglu", True, False, True) == dict.fromkeys(FUSION_KEYS, False)


@pytest.mark.parametrize("impl,apex,rope,wgrad", [("local", False, False, False), ("local", True, False, True),
                                                   ("transformer_engine", False, True, False),
                                                   ("transformer_engine", True, True, True)])
def test_gpu_turns_on_what_its_libraries_allow(impl, apex, rope, wgrad):
    got = fusion_settings(impl, True, "swiglu", True, False, apex)
    assert got["bias_activation_fusion"] and got["bias_dropout_fusion"]
    assert got["apply_rope_fusion"] is rope and got["gradient_accumulation_fusion"] is wgrad
    assert not got["masked_softmax_fusion"] and not got["persist_layer_norm"]


def test_activation_fusion_only_where_megatron_has_a_kernel():
    assert activation_fusable("swiglu", True, False)
    assert activation_fusable("gelu", True, False) and activation_fusable("gelu", False, True)
    assert not activation_fusable("gelu", False, False)  # megatron asserts a bias for plain GELU fusion
    assert not activation_fusable("silu", False, False)  # "Only support fusion of gelu and swiglu"
    assert not fusion_settings("local", True, "silu", False, False, False)["bias_activation_fusion"]


def test_the_cpu_model_config_has_no_fusion(megatron_single):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import transformer_config

    config = transformer_config(tiny_arch())
    assert {key: getattr(config, key) for key in FUSION_KEYS} == dict.fromkeys(FUSION_KEYS, False)
