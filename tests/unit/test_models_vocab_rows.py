"""Row counts a full vocab tensor may have, and re-padding between layouts (pure functions, no megatron)."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.models.vocab_rows import padded_vocab_by_tp, repad_vocab, vocab_rows_problem

ARCH = tiny_arch(vocab_size=300)  # 4 heads: TP 1, 2, 4 -> padded 384, 512, 512
V = 300


def test_padded_sizes_are_the_tp_sizes_megatron_allows():
    assert padded_vocab_by_tp(ARCH) == {1: 384, 2: 512, 4: 512}
    qwen_like = tiny_arch(vocab_size=151643, num_attention_heads=28, num_query_groups=4, hidden_size=56)
    assert set(padded_vocab_by_tp(qwen_like)) == {1, 2, 4, 7, 14, 28}


@pytest.mark.parametrize("rows", [300, 384, 512])
def test_accepted_row_counts(rows):
    assert vocab_rows_problem(rows, ARCH) is None


@pytest.mark.parametrize("rows, words", [(299, "fewer than the vocab of 300"), (1, "fewer"), (301, "neither"),
                                         (383, "neither"), (400, "neither"), (640, "neither"), (1024, "neither")])
def test_rejected_row_counts(rows, words):
    problem = vocab_rows_problem(rows, ARCH)
    assert problem is not None and words in problem and f"{rows} rows" in problem
    if words == "neither":
        assert "384 at TP 1; 512 at TP 2, 4" in problem


def test_a_larger_aligned_vocab_is_not_mistaken_for_padding():
    """151936 rows (a multiple of 128) against a 151643-token config: no TP of a 28-head model pads to it."""
    arch = tiny_arch(vocab_size=151643, num_attention_heads=28, num_query_groups=4, hidden_size=56)
    assert "neither" in vocab_rows_problem(151936, arch)
    assert vocab_rows_problem(151680, arch) is None  # TP 1


def _rows(n, h=4):
    return torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1).repeat(1, h)  # row i holds i + 1: never zero


def test_repad_hf_rows_pads_with_zeros():
    out = repad_vocab(_rows(V), "embedding.word_embeddings.weight", ARCH, 512)
    assert out.shape == (512, 4)
    assert torch.equal(out[:V], _rows(V))
    assert not out[V:].any()


def test_repad_same_layout_is_used_as_is():
    full = _rows(384)  # padding rows non-zero, as megatron's random init leaves them
    assert repad_vocab(full, "output_layer.weight", ARCH, 384) is full


@pytest.mark.parametrize("rows, padded", [(512, 384), (384, 512)])
def test_repad_other_layout_keeps_only_the_vocab(rows, padded):
    """Another layout's padding rows (beyond the true vocab) are dropped; this layout's padding is zero."""
    out = repad_vocab(_rows(rows), "output_layer.weight", ARCH, padded)
    assert out.shape == (padded, 4)
    assert torch.equal(out[:V], _rows(V))
    assert not out[V:].any()


@pytest.mark.parametrize("rows", [299, 301, 400, 1024])
def test_repad_mismatching_vocab_raises_with_name_and_counts(rows):
    with pytest.raises(ValueError) as e:
        repad_vocab(_rows(rows), "embedding.word_embeddings.weight", ARCH, 384)
    msg = str(e.value)
    assert "embedding.word_embeddings.weight" in msg and f"{rows} rows" in msg
    assert "expects 300 (padded to 384)" in msg
