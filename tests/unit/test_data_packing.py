"""THD packing: pack -> unpack is exact on random ragged batches; layout matches a plain-Python reference."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ppo.data.packing import PackLayout


@st.composite
def ragged_batches(draw):
    """[B, S] masks mixing left padding (prompts), right padding (responses) and both, plus an alignment."""
    batch, seq = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    rows = []
    for _ in range(batch):
        n = draw(st.integers(0, seq))
        start = draw(st.integers(0, seq - n))
        rows.append([1 if start <= j < start + n else 0 for j in range(seq)])
    return torch.tensor(rows, dtype=torch.long), draw(st.sampled_from([1, 2, 3, 8]))


def reference_pack(values, mask, align, pad):
    """Plain loops: concatenate each row's valid entries, pad each sequence to a multiple of `align`."""
    out, cu, cu_padded = [], [0], [0]
    for b in range(values.shape[0]):
        seq = [values[b, j] for j in range(values.shape[1]) if mask[b, j]]
        padded = -(-len(seq) // align) * align
        out += seq + [torch.full_like(values[0, 0], pad)] * (padded - len(seq))
        cu.append(cu[-1] + len(seq))
        cu_padded.append(cu_padded[-1] + padded)
    stacked = torch.stack(out) if out else values.new_zeros((0, *values.shape[2:]))
    return stacked, cu, cu_padded


@settings(max_examples=150, deadline=None)
@given(ragged_batches(), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_pack_matches_reference_and_unpack_is_exact(case, extra_dims, seed):
    mask, align = case
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(*mask.shape, *([3] * extra_dims), generator=gen, dtype=torch.float64)
    layout = PackLayout.from_mask(mask, align=align)
    packed = layout.pack(values, pad_value=-7.0)
    ref, cu, cu_padded = reference_pack(values, mask, align, -7.0)
    assert torch.equal(packed, ref)
    assert layout.cu_seqlens.dtype == layout.cu_seqlens_padded.dtype == torch.int32
    assert layout.cu_seqlens.tolist() == cu and layout.cu_seqlens_padded.tolist() == cu_padded
    assert layout.total_tokens % align == 0 and layout.num_padding_tokens == cu_padded[-1] - cu[-1]
    back = layout.unpack(packed, pad_value=0.0)
    keep = mask.bool().reshape(*mask.shape, *([1] * extra_dims))
    assert torch.equal(back, torch.where(keep, values, torch.zeros_like(values)))  # bitwise exact
    positions = layout.position_ids()
    for b in range(mask.shape[0]):
        assert positions[cu_padded[b]:cu_padded[b + 1]].tolist() == list(range(cu_padded[b + 1] - cu_padded[b]))


def test_token_ids_and_packed_seq_params():
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    mask = (torch.arange(5) >= 2).long().unsqueeze(0).repeat(3, 1)
    mask[1] = torch.tensor([1, 1, 0, 0, 0])
    mask[2] = 1
    layout = PackLayout.from_mask(mask, align=4)
    assert layout.pack(ids).tolist() == [5, 6, 7, 0, 8, 9, 0, 0, 1, 2, 3, 4, 5, 0, 0, 0]
    params = layout.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 8
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.tolist() == [0, 4, 8, 16]
    assert params.cu_seqlens_kv_padded.tolist() == [0, 4, 8, 16]
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 10]


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, seq\]"):
        PackLayout.from_mask(torch.ones(4))
    layout = PackLayout.from_mask(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"does not start with the layout's \[2, 3\]"):
        layout.pack(torch.ones(3, 2))
    with pytest.raises(ValueError, match="packed length 5 != layout's 6 tokens"):
        layout.unpack(torch.ones(5))
    with pytest.raises(ValueError, match="align=0"):
        PackLayout.from_mask(torch.ones(2, 3), align=0)
