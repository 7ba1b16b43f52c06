"""The rollout batch the driver passes between phases, and its packed micro-batches for the models.

Sequences are prompt + response with no padding, packed into one THD row with ``cu_seqlens``: rotary positions restart
per sequence, so a recomputed log-prob equals the one generation produced (left-padded rows would shift them).
Per-token quantities live in verl's layout, [B, R] right-padded over the response, and ``resp_pos`` maps that layout
into the packed row: response token j of row i is predicted at packed position start_i + P_i + j - 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_ppo.models.forward import pack_sequences


@dataclass
class RolloutBatch:
    prompt_ids: list[torch.Tensor]  # B 1-D long tensors
    responses: torch.Tensor  # [B, R] long, padded after each response
    response_mask: torch.Tensor  # [B, R] float32, 1 on response tokens (eos included); never changed after rollout
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token [B, R] (or per-row [B]) values
    meta: dict[str, list] = field(default_factory=dict)  # per-row python values (data_source, ground truth, ...)

    @property
    def size(self) -> int:
        return len(self.prompt_ids)

    @property
    def loss_mask(self) -> torch.Tensor:
        """The tokens losses and statistics count: response_mask, minus rejected tokens once rejection ran."""
        return self.tensors.get("loss_mask", self.response_mask)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    def num_tokens(self, rows) -> int:
        lengths = self.response_lengths
        return int(sum(self.prompt_ids[i].numel() + int(lengths[i]) for i in rows))


def pack_rows(batch: RolloutBatch, rows: list[int], keys: tuple[str, ...] = ()) -> dict:
    """One packed micro-batch of ``rows``: input_ids [1, T], cu_seqlens, resp_pos [b, R], plus ``keys`` from
    batch.tensors (indexed by rows), the response mask (which tokens exist) and the loss mask (which of them the
    losses count: the response mask minus tokens rejected by rollout correction)."""
    if not rows:
        raise ValueError("pack_rows: no rows")
    lengths = batch.response_lengths
    width = batch.responses.shape[1]
    sequences = [torch.cat([batch.prompt_ids[i], batch.responses[i, : int(lengths[i])]]) for i in rows]
    input_ids, cu_seqlens = pack_sequences(sequences)
    steps = torch.arange(width)
    resp_pos = torch.stack([
        (int(cu_seqlens[k]) + batch.prompt_ids[i].numel() - 1 + steps).clamp(max=int(cu_seqlens[k + 1]) - 1)
        for k, i in enumerate(rows)
    ])
    index = torch.as_tensor(rows, dtype=torch.long)
    micro = {"input_ids": input_ids, "cu_seqlens": cu_seqlens, "resp_pos": resp_pos,
             "response_mask": batch.response_mask[index], "loss_mask": batch.loss_mask[index]}
    for key in keys:
        micro[key] = batch.tensors[key][index]
    return micro


def split_rows(rows: list[int], size: int) -> list[list[int]]:
    """Consecutive chunks of at most ``size`` rows."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [rows[i: i + size] for i in range(0, len(rows), size)]


def gather_response(per_token: torch.Tensor, micro: dict) -> torch.Tensor:
    """[1, T] (or [T]) packed per-token values -> [b, R] in the response layout."""
    return per_token.reshape(-1)[micro["resp_pos"]]
