"""Which row counts a full vocab-sized tensor (word embeddings, output layer) may have, and re-padding between layouts.

Rows ``[0, vocab)`` are the real tokens. Megatron pads the vocab to a multiple of ``make_vocab_size_divisible_by x
TP`` (``ModelArch.padded_vocab_size``); the rows beyond ``vocab`` are padding that no token id reaches. A full tensor
of an architecture is accepted iff its row count is

* the vocab itself (an HF tensor), or
* the padded vocab at a TP size megatron allows for the architecture (TP divides ``num_attention_heads``): a tensor
  saved or gathered from any Megatron layout of this model.

Any other count is a checkpoint of a different vocabulary: fewer rows would leave real tokens zero, more rows would
silently drop real tokens, so both raise. Only the shape can be checked: megatron initialises its padding rows
randomly, so "the extra rows are zero" does not hold for a freshly built or trained model.
"""
from __future__ import annotations

import torch

from megatron_ppo.models.arch import ModelArch


def padded_vocab_by_tp(arch: ModelArch) -> dict[int, int]:
    """{TP size megatron allows for ``arch``: the padded vocab at that TP}."""
    heads = arch.num_attention_heads
    return {tp: arch.padded_vocab_size(tp) for tp in range(1, heads + 1) if heads % tp == 0}


def vocab_rows_problem(rows: int, arch: ModelArch) -> str | None:
    """Why ``rows`` cannot be the row count of a full vocab tensor of ``arch`` (None: it can)."""
    vocab = arch.vocab_size
    padded = padded_vocab_by_tp(arch)
    if rows == vocab or rows in padded.values():
        return None
    if rows < vocab:
        return f"{rows} rows, fewer than the vocab of {vocab} tokens (a checkpoint of a smaller vocabulary)"
    by_rows: dict[int, list[int]] = {}
    for tp, n in padded.items():
        by_rows.setdefault(n, []).append(tp)
    allowed = "; ".join(f"{n} at TP {', '.join(map(str, tps))}" for n, tps in sorted(by_rows.items()))
    return (f"{rows} rows, neither the vocab of {vocab} tokens nor megatron's padding of it (a multiple of "
            f"make_vocab_size_divisible_by={arch.make_vocab_size_divisible_by} x TP, TP dividing "
            f"num_attention_heads={arch.num_attention_heads}: {allowed}): a checkpoint of a larger vocabulary")


def check_vocab_rows(name: str, rows: int, arch: ModelArch, padded: int | None = None) -> None:
    """Raise ValueError naming ``name`` when ``vocab_rows_problem`` rejects ``rows``."""
    problem = vocab_rows_problem(rows, arch)
    if problem:
        target = f" (padded to {padded})" if padded is not None else ""
        raise ValueError(f"{name}: {problem}; the model expects {arch.vocab_size}{target}")


def repad_vocab(full: torch.Tensor, name: str, arch: ModelArch, padded: int) -> torch.Tensor:
    """``full`` with ``padded`` rows: rows [0, vocab) copied, rows [vocab, padded) zero.

    A tensor that already has ``padded`` rows (the same layout) is returned as is, padding included, so that
    gather -> load round trips are exact. Raises ValueError naming the tensor for a row count
    ``vocab_rows_problem`` rejects.
    """
    rows = full.shape[0]
    check_vocab_rows(name, rows, arch, padded)
    if rows == padded:
        return full
    vocab = arch.vocab_size
    out = full.new_zeros((padded,) + tuple(full.shape[1:]))
    out[:vocab] = full[:vocab]
    return out
