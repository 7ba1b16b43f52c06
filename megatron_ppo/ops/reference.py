"""Torch references for the kernels: the fallback when an extension is missing and the oracle in tests.

- GAE: ``algo.advantages.compute_gae_advantage_return`` itself (the semantics the kernels must reproduce).
- Log-prob/entropy: the same decomposition as the kernels (per-row partial statistics, then a backward from the
  finished log-normaliser and entropy), in plain torch, ``chunk_rows`` rows at a time so that the float32
  temporaries stay at chunk_rows x V instead of N x V. ``logprobs_entropy_naive`` is the textbook
  log_softmax + gather + entropy that materialises [N, V] (tests and benchmarks compare against it).
"""
from __future__ import annotations

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries per chunk: 64 MiB each


def gae(token_level_rewards, values, response_mask, gamma, lam):
    from megatron_ppo.algo.advantages import compute_gae_advantage_return

    return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)


def stats_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """Accumulation/output dtype of the statistics: float64 for float64 logits, float32 otherwise."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def rows_per_chunk(vocab: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    return max(1, chunk_elements // max(1, vocab))


def lse_partials(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, inv_temperature: float = 1.0,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """[4, N] of x = logits * inv_temperature: local max M, sum exp(x - M), sum exp(x - M)(x - M), target logit
    (0 outside this shard)."""
    n_rows, vocab = logits.shape
    dtype = stats_dtype(logits.dtype)
    out = torch.empty(4, n_rows, dtype=dtype, device=logits.device)
    step = rows_per_chunk(vocab, chunk_elements)
    for start in range(0, n_rows, step):
        x = logits[start:start + step].to(dtype)
        if inv_temperature != 1.0:
            x = x * inv_temperature
        m = x.amax(dim=-1) if vocab else torch.full((x.shape[0],), float("-inf"), dtype=dtype, device=x.device)
        has_nan = torch.isnan(x).any(dim=-1)
        m = torch.where(has_nan, torch.full_like(m, float("nan")), m)
        all_neg_inf = m == float("-inf")
        shifted = x - torch.where(all_neg_inf, torch.zeros_like(m), m).unsqueeze(-1)
        e = torch.exp(shifted)
        out[0, start:start + step] = m
        out[1, start:start + step] = e.sum(-1)
        out[2, start:start + step] = torch.where(e == 0, torch.zeros_like(e), e * shifted).sum(-1)
        local = target[start:start + step] - vocab_start
        mine = (local >= 0) & (local < vocab)
        picked = x.gather(-1, local.clamp(0, max(vocab - 1, 0)).unsqueeze(-1)).squeeze(-1) if vocab else m
        out[3, start:start + step] = torch.where(mine, picked, torch.zeros_like(picked))
    return out


def lse_backward(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, inv_temperature: float,
                 log_z: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor,
                 out: torch.Tensor | None = None, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """With x = t * logits (t = inv_temperature), p_j = exp(x_j - log_z):
    grad_j = t * (-p_j (g_lp + g_ent (x_j - log_z + H)) + g_lp [j == target])."""
    n_rows, vocab = logits.shape
    dtype = stats_dtype(logits.dtype)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out
    step = rows_per_chunk(vocab, chunk_elements)
    for start in range(0, n_rows, step):
        stop = min(n_rows, start + step)
        x = logits[start:stop].to(dtype)
        if inv_temperature != 1.0:
            x = x * inv_temperature
        lz, h = log_z[start:stop].to(dtype).unsqueeze(-1), entropy[start:stop].to(dtype).unsqueeze(-1)
        glp, gent = grad_logp[start:stop].to(dtype).unsqueeze(-1), grad_entropy[start:stop].to(dtype).unsqueeze(-1)
        p = torch.exp(x - lz)
        g = torch.where(p == 0, torch.zeros_like(p), -p * (glp + gent * (x - lz + h)))
        local = target[start:stop] - vocab_start
        mine = (local >= 0) & (local < vocab)
        idx = local.clamp(0, max(vocab - 1, 0)).unsqueeze(-1)
        g.scatter_add_(-1, idx, torch.where(mine.unsqueeze(-1), glp, torch.zeros_like(glp)))
        if inv_temperature != 1.0:
            g = g * inv_temperature
        grad[start:stop] = g.to(logits.dtype)
    return grad


def logprobs_entropy_naive(logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax + gather + entropy on the full [.., V] tensor in float32 (float64 stays float64); differentiable
    through torch autograd. Materialises several [N, V] float32 tensors: the memory baseline."""
    x = logits.to(stats_dtype(logits.dtype))
    logp_all = torch.log_softmax(x, dim=-1)
    log_probs = logp_all.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    entropy = -(torch.where(p == 0, torch.zeros_like(p), p * logp_all)).sum(-1)
    return log_probs, entropy
