"""One micro-batch through a GPTModel: the micro-batch dict, packed (THD) params, and the forward call.

A micro-batch is a dict with
  "input_ids":   LongTensor [B, S] (padded rows) or [1, T] (packed sequences, with "cu_seqlens"),
  "cu_seqlens":  optional int32 [n+1] boundaries of the packed sequences (THD layout; alignment padding is
                 part of the sequence it follows, as ``pack_sequences`` and ``data.batch.pack_rows`` pack it),
  "attention_mask": optional megatron mask (bool, True = masked) for padded rows; None = causal,
  "position_ids": optional (RoPE models ignore it: rotary positions restart per packed sequence anyway),
  "logit_positions": optional long [N], positions into the flattened input_ids (``data.batch.pack_rows`` sets
                 the ones that predict response tokens): an actor/ref model then returns logits only there,
                 [1, N, V/TP] (``models.gpt``); value models ignore it,
plus whatever the loss function reads (response masks, advantages, old log-probs, ...).
"""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ppo.models.unwrap import unwrap_model


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> PackedSeqParams:
    """THD PackedSeqParams for self-attention over packed sequences bounded by ``cu_seqlens``."""
    cu = cu_seqlens.to(torch.int32)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D [n+1] starting at 0, got {cu.tolist()[:8]}...")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    max_s = int(lengths.max()) if max_seqlen is None else int(max_seqlen)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max_s, max_seqlen_kv=max_s)


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
    cu = batch.get("cu_seqlens")
    psp = batch.get("packed_seq_params")
    if cu is not None and psp is None:
        if input_ids.shape[0] != 1:
            raise ValueError(f"packed micro-batch must have input_ids [1, T], got {tuple(input_ids.shape)}")
        if int(cu[-1]) != input_ids.shape[1]:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but input_ids has {input_ids.shape[1]} tokens")
        psp = packed_seq_params(cu)
    inner = unwrap_model(model)
    config = inner.config
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
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= num_tokens):
        raise ValueError(f"micro-batch 'logit_positions' must lie in [0, {num_tokens}) (the input's tokens), got "
                         f"[{int(positions.min())}, {int(positions.max())}]")
