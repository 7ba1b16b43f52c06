"""Round-trip proofs the conversion tests use: two HF checkpoint directories compared bit by bit, and a greedy
continuation by full re-forwards that depends on no generation code.
"""
from __future__ import annotations

import torch

from megatron_ppo.convert.hf_io import HFCheckpoint
from megatron_ppo.convert.verify import megatron_logits


@torch.no_grad()
def megatron_greedy(model, input_ids: torch.Tensor, vocab_size: int, new_tokens: int) -> torch.Tensor:
    """Greedy continuation by full re-forwards (no cache): slow but independent of any generation code (PP=1)."""
    ids = input_ids
    for _ in range(new_tokens):
        nxt = megatron_logits(model, ids, vocab_size)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, input_ids.shape[1]:]


def compare_hf_checkpoints(dir_a: str, dir_b: str) -> list[str]:
    """Differences between two HF checkpoint dirs: names, dtypes, shapes, and any bit of any tensor."""
    a, b = HFCheckpoint(dir_a), HFCheckpoint(dir_b)
    diffs = [f"only in {dir_a}: {n}" for n in sorted(set(a.entries) - set(b.entries))]
    diffs += [f"only in {dir_b}: {n}" for n in sorted(set(b.entries) - set(a.entries))]
    for name in sorted(set(a.entries) & set(b.entries)):
        ta, tb = a.read([name])[name], b.read([name])[name]
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            diffs.append(f"{name}: {ta.dtype} {tuple(ta.shape)} vs {tb.dtype} {tuple(tb.shape)}")
        elif not torch.equal(ta.view(torch.uint8) if ta.dim() else ta, tb.view(torch.uint8) if tb.dim() else tb):
            diffs.append(f"{name}: values differ (max abs {float((ta.float() - tb.float()).abs().max()):.3g})")
    return diffs
