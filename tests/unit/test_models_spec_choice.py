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


def _torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    """torch 2.10's varlen_attn signature (no scale, window or GQA), computed per sequence with SDPA's defaults."""
    assert query.shape[-2] == key.shape[-2], "this signature has no GQA: K/V must come repeated"
    out = []
    for a, b in zip(cu_seq_q.tolist(), cu_seq_q.tolist()[1:]):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal).transpose(0, 1))
    return torch.cat(out)


def test_varlen_kernel_is_used_with_whichever_causal_keyword_torch_has():
    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        raise AssertionError("never called")

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        raise AssertionError("never called")

    assert attention.varlen_usable(_torch_2_10) and attention.varlen_usable(torch_2_13)
    assert not attention.varlen_usable(no_causal) and not attention.varlen_usable(None)
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    q2, k2, v2, kwargs = attention.varlen_arguments(attention._parameters(torch_2_13), q, k, v, 0.3)
    assert kwargs == {"window_size": (-1, 0), "scale": 0.3, "enable_gqa": True} and q2 is q and k2 is k
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        pytest.skip("this torch has no varlen_attn")
    assert attention.varlen_usable(varlen_attn) == (attention._varlen_attn is not None)


def test_varlen_arguments_make_up_for_an_old_signature():
    """Without scale / enable_gqa the query is pre-scaled and K/V repeated: the result is causal GQA attention at
    the module's scale, as the per-sequence SDPA strategy computes it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q2, k2, v2, kwargs = attention.varlen_arguments(attention._parameters(_torch_2_10), q, k, v, 0.3)
    assert kwargs == {"is_causal": True}
    got = _torch_2_10(q2, k2, v2, cu, cu, 5, 5, **kwargs)
    want = []
    for a, b in ((0, 4), (4, 9)):
        want.append(torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=0.3,
            enable_gqa=True).transpose(0, 1))
    torch.testing.assert_close(got, torch.cat(want))
