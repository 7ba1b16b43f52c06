"""Which attention a model gets where Transformer Engine or torch's varlen kernel cannot run it (issue 23, items 3-4).

* TE + fp32 + packed THD has no attention backend (TE's unfused backend is off for THD, flash/fused need fp16/bf16):
  under transformer_impl=auto an fp32 model takes the local spec; an explicit 'transformer_engine' is refused with
  the reason. TE cannot be installed on a CPU machine (its import error breaks megatron.core), so its availability
  is set by the test; the choice is what is tested.
* torch's varlen_attn before 2.13 lacks the keywords we pass: such a kernel is not used (per-sequence SDPA instead),
  rather than raising TypeError mid-forward on the first bf16 packed batch.
"""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models import attention, spec


@pytest.fixture
def te_importable(monkeypatch):
    monkeypatch.setattr(spec, "transformer_engine_available", lambda: True)


def test_auto_keeps_fp32_off_transformer_engine(te_importable):
    assert spec.resolve_transformer_impl("auto", torch.float32) == "local"
    assert spec.resolve_transformer_impl("auto", torch.bfloat16) == "transformer_engine"
    assert spec.resolve_transformer_impl("auto", torch.float16) == "transformer_engine"
    assert spec.resolve_transformer_impl("local", torch.bfloat16) == "local"


def test_explicit_transformer_engine_with_fp32_is_refused_with_the_reason(te_importable):
    with pytest.raises(ValueError, match="no attention backend for packed THD micro-batches in torch.float32"):
        spec.resolve_transformer_impl("transformer_engine", torch.float32)
    assert spec.resolve_transformer_impl("transformer_engine", torch.bfloat16) == "transformer_engine"


def test_without_transformer_engine_everything_is_local(monkeypatch):
    monkeypatch.setattr(spec, "transformer_engine_available", lambda: False)
    assert spec.resolve_transformer_impl("auto", torch.bfloat16) == "local"
    with pytest.raises(RuntimeError, match="not usable here"):
        spec.resolve_transformer_impl("transformer_engine", torch.bfloat16)


def test_varlen_kernel_is_used_only_with_the_keywords_we_pass():
    def torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
        raise AssertionError("never called")

    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        raise AssertionError("never called")

    assert not attention.varlen_usable(torch_2_9)
    assert attention.varlen_usable(torch_2_13)
    assert not attention.varlen_usable(None)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        pytest.skip("this torch has no varlen_attn")
    assert attention.varlen_usable(varlen_attn) == (attention._varlen_attn is not None)
