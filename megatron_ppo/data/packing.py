"""Padding removal into one packed sequence (Megatron's THD layout) and exact unpacking.

A [B, S] batch with an attention mask becomes one stream of the valid tokens, sequence after sequence;
`cu_seqlens` (int32, [B+1]) marks where each sequence starts, as Megatron's `PackedSeqParams` takes it.
With `align > 1` every sequence is padded at its end to a multiple of `align` (tensor parallel with sequence
parallel needs multiples of TP; context parallel 2*CP*TP), and `cu_seqlens_padded` describes that stream.
All index maps are built with tensor ops (no Python loop over the batch) and stay on the mask's device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackLayout:
    """Where each valid token of a [B, S] batch sits in the packed stream, and back."""

    batch_size: int
    seq_len: int
    seqlens: torch.Tensor  # int32 [B]: valid tokens per sequence
    cu_seqlens: torch.Tensor  # int32 [B+1]: cumulative valid lengths
    cu_seqlens_padded: torch.Tensor  # int32 [B+1]: cumulative lengths after per-sequence alignment padding
    max_seqlen: int  # longest aligned sequence
    src: torch.Tensor  # int64 [N]: flat positions (b * S + s) of the valid tokens
    dst: torch.Tensor  # int64 [N]: their positions in the packed stream

    @classmethod
    def from_mask(cls, attention_mask: torch.Tensor, align: int = 1) -> "PackLayout":
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [batch, seq]; got shape {tuple(attention_mask.shape)}")
        if align < 1:
            raise ValueError(f"align={align} must be >= 1")
        mask = attention_mask.bool()
        batch, seq = mask.shape
        seqlens = mask.sum(dim=1, dtype=torch.int32)
        padded = (seqlens + align - 1) // align * align
        zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
        cu = torch.cat([zero, seqlens.cumsum(0, dtype=torch.int32)])
        cu_padded = torch.cat([zero, padded.cumsum(0, dtype=torch.int32)])
        src = mask.flatten().nonzero().squeeze(1)
        rank_in_row = (mask.cumsum(dim=1) - 1).flatten()[src]
        dst = cu_padded[src // seq].long() + rank_in_row
        max_seqlen = int(padded.max()) if batch else 0
        return cls(batch, seq, seqlens, cu, cu_padded, max_seqlen, src, dst)

    @property
    def total_tokens(self) -> int:
        """Length of the packed stream, alignment padding included."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def num_padding_tokens(self) -> int:
        return self.total_tokens - int(self.cu_seqlens[-1])

    def pack(self, values: torch.Tensor, pad_value=0) -> torch.Tensor:
        """[B, S, *] -> [T, *]: the valid entries, packed; alignment slots hold `pad_value`."""
        if tuple(values.shape[:2]) != (self.batch_size, self.seq_len):
            raise ValueError(f"values shape {tuple(values.shape)} does not start with the layout's "
                             f"[{self.batch_size}, {self.seq_len}]")
        flat = values.reshape(self.batch_size * self.seq_len, *values.shape[2:])
        out = flat.new_full((self.total_tokens, *values.shape[2:]), pad_value)
        out[self.dst] = flat[self.src]
        return out

    def unpack(self, packed: torch.Tensor, pad_value=0) -> torch.Tensor:
        """[T, *] -> [B, S, *]: inverse of `pack` on valid positions; the rest holds `pad_value`."""
        if packed.shape[0] != self.total_tokens:
            raise ValueError(f"packed length {packed.shape[0]} != layout's {self.total_tokens} tokens")
        out = packed.new_full((self.batch_size * self.seq_len, *packed.shape[1:]), pad_value)
        out[self.src] = packed[self.dst]
        return out.reshape(self.batch_size, self.seq_len, *packed.shape[1:])

    def position_ids(self) -> torch.Tensor:
        """[T] int64: 0, 1, ... restarting at each sequence of the packed stream."""
        lengths = (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).long()
        starts = torch.repeat_interleave(self.cu_seqlens_padded[:-1].long(), lengths)
        return torch.arange(self.total_tokens, device=starts.device) - starts

    def packed_seq_params(self):
        """Megatron's PackedSeqParams (qkv_format="thd") for this layout.

        As verl's Megatron path does, the aligned boundaries serve as the sequence boundaries: alignment slots sit
        after a sequence's last token, so under causal attention no real token attends to them.
        """
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens_padded
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)
