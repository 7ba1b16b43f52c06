"""The rollout batch the driver and the workers pass around, and its packed micro-batches for the models: the one
packer of the project.

Layout (THD): sequences are prompt + response with no padding between tokens, packed into one [1, T] row with
``cu_seqlens`` (int32 [b+1]). Rotary positions restart per sequence, so a recomputed log-prob equals the one
generation produced (left-padded rows would shift them). With ``align > 1`` each sequence is padded at its end to a
multiple of ``align`` (tensor parallelism with sequence parallelism needs T to be a multiple of TP, context
parallelism 2*CP*TP) and ``cu_seqlens`` includes that padding, as verl's Megatron path does: the slots sit after a
sequence's last token, so under causal attention no real token attends to them.

Per-token quantities live in verl's layout, [B, R] right-padded over the response, and ``resp_pos`` maps that layout
into the packed row: response token j of row i is predicted at packed position start_i + P_i + j - 1. The distinct
positions resp_pos reads are ``logit_positions`` (the actor's and reference's models compute logits only there) and
``logit_index`` maps each [b, R] slot to one of them.

Micro-batches: a fixed number of rows (``chunk_rows``) or a token budget (``micro_batches_by_tokens``, on
``data.dynamic_batch.plan_micro_batches``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from megatron_ppo.data.dynamic_batch import plan_micro_batches
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

    def row_tokens(self) -> list[int]:
        """Tokens per row (prompt + response): the weights of the DP split."""
        lengths = self.response_lengths.tolist()
        return [int(p.numel()) + int(n) for p, n in zip(self.prompt_ids, lengths)]

    def num_tokens(self, rows) -> int:
        tokens = self.row_tokens()
        return int(sum(tokens[i] for i in rows))

    def select(self, rows=None, keys=None, meta: bool = True) -> "RolloutBatch":
        """The batch restricted to ``rows`` (default: all, in order) and, when ``keys`` is given, to those per-token
        tensors (plus the loss mask once rejection wrote one); ``meta=False`` drops the per-row python values.
        ``select(keys=..., meta=False)`` is what crosses the driver -> rank boundary: token ids, masks and the
        tensors the call needs, split by row over DP (distributed/dispatch.select_rows)."""
        names = list(self.tensors) if keys is None else list(dict.fromkeys(
            tuple(keys) + (("loss_mask",) if "loss_mask" in self.tensors else ())))
        if rows is None:  # every row: the same tensors, no copy
            return RolloutBatch(list(self.prompt_ids), self.responses, self.response_mask,
                                {key: self.tensors[key] for key in names},
                                {key: list(values) for key, values in self.meta.items()} if meta else {})
        rows = list(rows)
        index = torch.as_tensor(rows, dtype=torch.long)
        return RolloutBatch([self.prompt_ids[i] for i in rows], self.responses[index], self.response_mask[index],
                            {key: self.tensors[key][index] for key in names},
                            {key: [values[i] for i in rows] for key, values in self.meta.items()} if meta else {})


def _check_align(align: int) -> None:
    if align < 1:
        raise ValueError(f"align={align} must be >= 1 (TP with sequence parallelism: TP; context parallelism: "
                         "2*CP*TP)")


def packed_num_tokens(lengths: Sequence[int], align: int = 1) -> int:
    """Length T of the packed row of sequences of these lengths, each padded to a multiple of ``align``."""
    _check_align(align)
    return sum(-(-int(n) // align) * align for n in lengths)


def pack_rows(batch: RolloutBatch, rows: list[int], keys: tuple[str, ...] = (), align: int = 1) -> dict:
    """One packed micro-batch of ``rows``: input_ids [1, T], cu_seqlens (and ``seq_bounds``, the same as host ints:
    the device never reads them back), resp_pos [b, R], logit_positions [N] and
    logit_index [b, R] (``response_positions``), plus ``keys`` from
    batch.tensors (indexed by rows), the response mask (which tokens exist) and the loss mask (which of them the
    losses count: the response mask minus tokens rejected by rollout correction). ``align``: pad each sequence
    to a multiple of it (see the module docstring); resp_pos never points into that padding."""
    if not rows:
        raise ValueError("pack_rows: no rows")
    _check_align(align)
    lengths = batch.response_lengths
    width = batch.responses.shape[1]
    sequences = [torch.cat([batch.prompt_ids[i], batch.responses[i, : int(lengths[i])]]) for i in rows]
    input_ids, cu_seqlens = pack_sequences(sequences, align=align)
    steps = torch.arange(width)
    resp_pos = torch.stack([
        (int(cu_seqlens[k]) + batch.prompt_ids[i].numel() - 1 + steps).clamp(
            max=int(cu_seqlens[k]) + sequences[k].numel() - 1)  # past the response: its last real token
        for k, i in enumerate(rows)
    ])
    index = torch.as_tensor(rows, dtype=torch.long)
    logit_positions, logit_index = response_positions(resp_pos)
    micro = {"input_ids": input_ids, "cu_seqlens": cu_seqlens, "seq_bounds": tuple(cu_seqlens.tolist()),
             "resp_pos": resp_pos,
             "logit_positions": logit_positions, "logit_index": logit_index,
             "response_mask": batch.response_mask[index], "loss_mask": batch.loss_mask[index]}
    for key in keys:
        micro[key] = batch.tensors[key][index]
    return micro


def chunk_rows(rows: list[int], size: int) -> list[list[int]]:
    """Consecutive chunks of at most ``size`` rows."""
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    return [rows[i: i + size] for i in range(0, len(rows), size)]


def micro_batches_by_tokens(batch: RolloutBatch, rows: list[int], max_tokens: int, align: int = 1,
                            **plan_options) -> list[list[int]]:
    """``rows`` cut into micro-batches whose packed length (``pack_rows(..., align=align)``) is <= max_tokens
    (use_dynamic_bsz / ppo_max_token_len_per_gpu), every row in exactly one, balanced by
    ``data.dynamic_batch.plan_micro_batches`` (``plan_options``: min_num_micro_batches, divisible_by, balance,
    reduce_max for agreeing on the count across DP ranks). Returns lists of rows, each in ascending position in
    ``rows``; for rows = range(B), ``dynamic_batch.restore_order(outputs, plan)`` puts outputs back in row order."""
    if not rows:
        raise ValueError("micro_batches_by_tokens: no rows")
    responses = batch.response_lengths
    lengths = [packed_num_tokens([batch.prompt_ids[i].numel() + int(responses[i])], align) for i in rows]
    for row, n in zip(rows, lengths):
        if n > max_tokens:
            raise ValueError(f"row {row} has {n} tokens (prompt + response, aligned to {align}) > max_tokens="
                             f"{max_tokens} (ppo_max_token_len_per_gpu); a sequence cannot be split across "
                             "micro-batches")
    plan = plan_micro_batches([lengths], max_tokens, **plan_options)[0]
    return [[rows[j] for j in micro] for micro in plan]


def response_positions(resp_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [N], index [b, R]): the distinct packed positions ``resp_pos`` reads, ascending, and each slot's
    index among them (positions[index] == resp_pos). A model output computed only at ``positions`` holds every
    value the response layout needs: N <= T, and the padding slots past a response share one position per row."""
    positions, index = torch.unique(resp_pos, sorted=True, return_inverse=True)
    return positions, index


def at_logit_positions(num_positions: int, micro: dict) -> bool:
    """Whether a model output with ``num_positions`` along the sequence holds the micro-batch's
    ``logit_positions`` only (True) or every packed position (False); anything else is an error."""
    positions = micro.get("logit_positions")
    if positions is not None and num_positions == positions.numel():
        return True  # (N == T only when positions == arange(T): both readings then agree)
    total = micro["input_ids"].numel()
    if num_positions == total:
        return False
    expected = f"{total} (every packed position)" + ("" if positions is None else
                                                    f" or {positions.numel()} (logit_positions)")
    raise ValueError(f"model output has {num_positions} positions; the micro-batch expects {expected}")


def gather_response(per_token: torch.Tensor, micro: dict, at_positions: bool = False) -> torch.Tensor:
    """Packed per-token values -> [b, R] in the response layout: [1, T] (or [T]) over every packed position, or
    (``at_positions``) [1, N] / [N] over the micro-batch's ``logit_positions``."""
    if at_positions:
        return per_token.reshape(-1)[micro["logit_index"]]
    return per_token.reshape(-1)[micro["resp_pos"]]
