"""One micro-batch through a GPTModel: the micro-batch dict, packed (THD) params, and the forward call.

A micro-batch is a dict with
  "input_ids":   LongTensor [B, S] (padded rows) or [1, T] (packed sequences, with "cu_seqlens"),
  "cu_seqlens":  optional int32 [n+1] boundaries of the packed sequences (THD layout; alignment padding is
                 part of the sequence it follows, as ``pack_sequences`` and ``data.batch.pack_rows`` pack it),
  "seq_bounds":  optional, the same boundaries as a tuple of host ints (``pack_rows`` sets it): the forward then
                 reads nothing back from the device; without it ``cu_seqlens`` is read once per micro-batch,
  "attention_mask": optional megatron mask (bool, True = masked) for padded rows; None = causal,
  "position_ids": optional (RoPE models ignore it: rotary positions restart per packed sequence anyway),
  "logit_positions": optional long [N], positions into the flattened input_ids (``data.batch.pack_rows`` sets
                 the ones that predict response tokens): an actor/ref model then returns logits only there,
                 [1, N, V/TP] (``models.gpt``); value models ignore it,
plus whatever the loss function reads (response masks, advantages, old log-probs, ...).
"""
from __future__ import annotations

import dataclasses

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ppo.algo import checks
from megatron_ppo.models.unwrap import unwrap_model


def check_bounds(bounds, num_tokens: int | None = None) -> tuple[int, ...]:
    """``bounds`` (cu_seqlens as host ints) validated: 1-D, starts at 0, non-decreasing, ends at ``num_tokens``."""
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must be 1-D [n+1] starting at 0, got {list(bounds[:8])}...")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    if num_tokens is not None and bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but input_ids has {num_tokens} tokens")
    return bounds


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int | None = None,
                      bounds: tuple[int, ...] | None = None, num_tokens: int | None = None) -> PackedSeqParams:
    """THD PackedSeqParams for self-attention over packed sequences bounded by ``cu_seqlens`` (megatron's own type:
    what Transformer Engine's attention and fused RoPE read). ``bounds``: the same boundaries as host ints, when
    the caller has them; else they are read from ``cu_seqlens`` once."""
    cu = cu_seqlens.to(torch.int32)
    if cu.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D [n+1], got shape {tuple(cu.shape)}")
    bounds = check_bounds(cu.tolist() if bounds is None else bounds, num_tokens)
    max_s = max(b - a for a, b in zip(bounds, bounds[1:])) if max_seqlen is None else int(max_seqlen)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max_s, max_seqlen_kv=max_s)


@dataclasses.dataclass
class PackedSequences(PackedSeqParams):
    """THD params for the local spec, whose attention (models/attention.py) and RoPE (models/gpt.py) need no host
    read per layer: the boundaries travel as host ints (``bounds``, read once per micro-batch or never) and as a
    device tensor (``cu_seqlens``), with each token's position in its sequence (``positions``, computed on the
    device). megatron's ``cu_seqlens_*`` fields stay None on purpose: megatron's attention then applies the rotary
    embedding elementwise with the per-token frequencies the model gathered once, instead of its THD RoPE, which
    reads ``cu_seqlens`` back and loops over the sequences for q and k in every layer."""

    cu_seqlens: torch.Tensor | None = None
    bounds: tuple[int, ...] = ()
    positions: torch.Tensor | None = None
    pad_index: torch.Tensor | None = None  # each token's row in the padded [n * max_seqlen] layout
    segments: torch.Tensor | None = None  # each token's sequence
    block_mask: object = None  # FlexAttention's document mask, built by the first layer that needs it


def packed_sequences(cu_seqlens: torch.Tensor, bounds: tuple[int, ...] | None = None,
                     num_tokens: int | None = None) -> PackedSequences:
    """``PackedSequences`` for ``cu_seqlens`` (one host read of it unless ``bounds`` are given)."""
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D [n+1], got shape {tuple(cu_seqlens.shape)}")
    bounds = check_bounds(cu_seqlens.tolist() if bounds is None else bounds, num_tokens)
    if len(bounds) != cu_seqlens.numel():
        raise ValueError(f"seq_bounds has {len(bounds)} entries but cu_seqlens {cu_seqlens.numel()}")
    cu = cu_seqlens.to(torch.int32)
    total = bounds[-1]
    token = torch.arange(total, device=cu.device)
    segment = torch.searchsorted(cu[1:].long(), token, right=True)  # each token's sequence
    positions = token - cu.long()[segment]
    max_s = max(b - a for a, b in zip(bounds, bounds[1:]))
    return PackedSequences(qkv_format="thd", max_seqlen_q=max_s, max_seqlen_kv=max_s, cu_seqlens=cu, bounds=bounds,
                           positions=positions, pad_index=segment * max_s + positions, segments=segment)


def pack_sequences(sequences: list[torch.Tensor], align: int = 1, pad_id: int = 0):
    """Concatenate 1-D token tensors into [1, T] with cu_seqlens; each sequence padded at its end to ``align``."""
    if not sequences:
        raise ValueError("pack_sequences: no sequences")
    pieces, bounds = [], [0]
    for i, seq in enumerate(sequences):
        if seq.dim() != 1 or seq.numel() == 0:
            raise ValueError(f"pack_sequences: sequence {i} must be a non-empty 1-D tensor, got {tuple(seq.shape)}")
        pad = (-seq.numel()) % align
        pieces.append(seq)
        if pad:
            pieces.append(seq.new_full((pad,), pad_id))
        bounds.append(bounds[-1] + seq.numel() + pad)
    ids = torch.cat(pieces).unsqueeze(0)
    return ids, torch.tensor(bounds, dtype=torch.int32, device=ids.device)


def model_forward(model, batch: dict):
    """Run ``model`` (this pipeline stage) on one micro-batch; returns the stage's output tensor.

    Last stage: logits [B, S, V/TP] (actor/ref; [1, N, V/TP] at ``batch["logit_positions"]`` when given) or
    values [B, S, 1] (critic/reward); other stages: hidden.
    """
    from megatron.core import parallel_state

    from megatron_ppo import roles

    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"micro-batch 'input_ids' must be [B, S] or [1, T], got shape {tuple(input_ids.shape)}")
    inner = unwrap_model(model)
    config = inner.config
    cu = batch.get("cu_seqlens")
    psp = batch.get("packed_seq_params")
    if cu is not None and psp is None:
        if input_ids.shape[0] != 1:
            raise ValueError(f"packed micro-batch must have input_ids [1, T], got {tuple(input_ids.shape)}")
        bounds = batch.get("seq_bounds")
        if config.transformer_impl == "local":
            psp = packed_sequences(cu, bounds, num_tokens=input_ids.shape[1])
        else:
            psp = packed_seq_params(cu, bounds=bounds, num_tokens=input_ids.shape[1])
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if config.sequence_parallel and input_ids.shape[1] % tp:
        raise ValueError(f"sequence parallel needs the sequence length ({input_ids.shape[1]}) to be a multiple of "
                         f"TP={tp}: pad (e.g. PackLayout align={tp})")
    extra = {}
    positions = batch.get("logit_positions")
    if positions is not None and getattr(inner, "role", None) in roles.NAMES and roles.spec(inner.role).kind == "lm":
        _check_positions(positions, input_ids.numel())
        extra["logit_positions"] = positions
    return model(input_ids, batch.get("position_ids"), batch.get("attention_mask"), packed_seq_params=psp, **extra)


def _check_positions(positions: torch.Tensor, num_tokens: int) -> None:
    if positions.dim() != 1 or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"micro-batch 'logit_positions' must be a 1-D integer tensor, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    checks.index_range(positions, "micro-batch 'logit_positions'", 0, num_tokens)
