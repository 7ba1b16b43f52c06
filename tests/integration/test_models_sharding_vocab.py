"""load_full_state_dict on a real megatron GPTModel (world of one, CPU): vocab tensors of another vocabulary raise a
ValueError naming the tensor and the row counts; HF-sized and other-layout tensors load with zero padding rows."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch

EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"
V = 300  # padded to 384 at TP1: 84 padding rows


def _model_and_full():
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.testing.sharding import gather_full_state_dict

    model = build_gpt_model(tiny_arch(vocab_size=V, tie_word_embeddings=False), "actor")
    full = gather_full_state_dict(model)
    assert full[EMB].shape[0] == full[OUT].shape[0] == 384
    return model, {k: v.clone() for k, v in full.items()}


def _with_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` rows of distinct non-zero values (so a zero row can only come from padding)."""
    g = torch.Generator().manual_seed(rows)
    return torch.rand((rows,) + tuple(t.shape[1:]), generator=g, dtype=t.dtype) + 1.0


@pytest.mark.parametrize("key", [EMB, OUT])
@pytest.mark.parametrize("rows", [V - 1, V + 1, 400])
def test_vocab_mismatch_raises_naming_tensor_and_rows(megatron_single, key, rows):
    from megatron_ppo.testing.sharding import load_full_state_dict

    model, full = _model_and_full()
    full[key] = _with_rows(full[key], rows)
    with pytest.raises(ValueError) as e:
        load_full_state_dict(model, full)
    msg = str(e.value)
    assert key in msg and f"{rows} rows" in msg and "expects 300 (padded to 384)" in msg, msg


@pytest.mark.parametrize("rows", [V, 512])  # HF (true vocab), the TP2 layout's padding of it
def test_vocab_rows_loaded_and_padding_zero(megatron_single, rows):
    from megatron_ppo.testing.sharding import gather_full_state_dict, load_full_state_dict

    model, full = _model_and_full()
    for key in (EMB, OUT):
        full[key] = _with_rows(full[key], rows)
    load_full_state_dict(model, full)
    got = gather_full_state_dict(model)
    for key in (EMB, OUT):
        assert got[key].shape[0] == 384
        assert torch.equal(got[key][:V], full[key][:V])
        assert not got[key][V:].any(), f"{key}: padding rows beyond the vocab must be zero"


def test_same_layout_round_trip_is_exact(megatron_single):
    """A tensor with exactly the padded rows is used as is, padding rows included (gather -> load is exact)."""
    from megatron_ppo.testing.sharding import gather_full_state_dict, load_full_state_dict

    model, full = _model_and_full()
    full = {k: _with_rows(v, v.shape[0]) if v.dim() else v for k, v in full.items()}
    load_full_state_dict(model, full)
    got = gather_full_state_dict(model)
    assert all(torch.equal(got[k], full[k]) for k in full)
