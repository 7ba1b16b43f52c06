"""Log-probabilities and entropy of target tokens from vocab-parallel logits (sharded over TP), fwd + bwd.

Each TP rank holds logits[:, start:end] of the padded vocab. Per token, only scalars cross ranks: the max (MAX
all-reduce), then sum exp(x - max), sum exp(x - max) * x and the target's logit (one SUM all-reduce). The backward
needs no communication: with p = softmax(x) and sum_px = sum_j p_j x_j,
    d logp_t / dx_j = 1[j = t] - p_j,      d H / dx_j = -p_j (x_j - sum_px),
evaluated on the local shard from the saved per-token scalars. Tokens are processed in chunks so the fp32
working set stays chunk_size x V/TP. Vocab entries at or beyond ``vocab_size`` (megatron's padding) are masked.

Per chunk, the statistics and the backward come from ``megatron_ppo.ops``' TP pieces (``partial_stats``,
``rebase_stats``, ``finish_stats``, ``logprobs_entropy_backward``: the fused kernels where built, else their torch
reference) when ops imports, which apply the temperature themselves; this module adds the TP all-reduces,
vocab-padding removal (the padded columns are cut off the shard, their gradient is 0) and chunking.
``impl='torch'`` keeps an independent all-torch path (the fallback, and a cross-check in tests).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_ppo.algo import checks

DEFAULT_CHUNK = 4096


def _tp_info(tp_group):
    if tp_group is None:
        parallel_state = sys.modules.get("megatron.core.parallel_state")  # not imported = not initialised
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            tp_group = parallel_state.get_tensor_model_parallel_group()
    if tp_group is None or not dist.is_initialized():
        return None, 0, 1
    return tp_group, dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _chunk_stats(x, targets, vocab_start, vocab_size, group, world):
    """Global per-token (max, sum_exp, sum_exp_x, target_logit) for one chunk x: [n, V_local] fp32 (scaled)."""
    v_local = x.shape[-1]
    col = torch.arange(vocab_start, vocab_start + v_local, device=x.device)
    valid_col = col < vocab_size
    if not bool(valid_col.all()):
        x = x.masked_fill(~valid_col, float("-inf"))
    local_max = x.max(dim=-1).values
    if world > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    m = local_max
    e = torch.exp(x - m.unsqueeze(-1))
    x0 = torch.where(valid_col, x, torch.zeros_like(x))
    in_shard = (targets >= vocab_start) & (targets < vocab_start + v_local)
    local_t = (targets - vocab_start).clamp(0, v_local - 1)
    t_logit = torch.where(in_shard, x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
    sums = torch.stack([e.sum(-1), (e * x0).sum(-1), t_logit], dim=0)
    if world > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return m, sums[0], sums[1], sums[2]


def _compute_dtype(logits):
    """fp32 for half/bf16/fp32 logits; fp64 stays fp64 (reference checks)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _ops_module():
    try:
        from megatron_ppo import ops
    except ImportError:
        return None
    needed = ("partial_stats", "rebase_stats", "finish_stats", "logprobs_entropy_backward")
    return ops if all(hasattr(ops, n) for n in needed) else None


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Chunked over tokens; per chunk either the torch path below or the ``megatron_ppo.ops`` TP pieces."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, temperature, chunk, group, world, use_ops):
        n, v_local = logits.shape
        n_valid = max(0, min(v_local, vocab_size - vocab_start))
        cdt = _compute_dtype(logits)
        logp = torch.empty(n, dtype=cdt, device=logits.device)
        ent = torch.empty_like(logp)
        stats = torch.empty(3, n, dtype=cdt, device=logits.device)  # max, log-normaliser, sum_px
        ops = _ops_module() if use_ops else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            t = targets[s:e]
            if ops is not None:
                part = ops.partial_stats(logits[s:e, :n_valid], t, vocab_start, temperature=temperature)
                gmax = part[0].clone()
                if world > 1:
                    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
                summed = ops.rebase_stats(part, gmax)
                if world > 1:
                    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
                lp, h, log_z = ops.finish_stats(gmax, summed)
                logp[s:e], ent[s:e] = lp, h
                stats[0, s:e], stats[1, s:e], stats[2, s:e] = gmax, log_z, h  # (ops layout: entropy)
                continue
            x = logits[s:e].to(cdt) / temperature
            m, se, sex, tl = _chunk_stats(x, t, vocab_start, vocab_size, group, world)
            log_z = m + torch.log(se)
            sum_px = sex / se
            logp[s:e] = tl - log_z
            ent[s:e] = log_z - sum_px
            stats[0, s:e], stats[1, s:e], stats[2, s:e] = m, log_z, sum_px
        ctx.save_for_backward(logits, targets, stats)
        ctx.cfg = (vocab_start, vocab_size, temperature, chunk, ops is not None)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, stats = ctx.saved_tensors
        vocab_start, vocab_size, temperature, chunk, with_ops = ctx.cfg
        n, v_local = logits.shape
        n_valid = max(0, min(v_local, vocab_size - vocab_start))
        grad = torch.zeros_like(logits) if n_valid < v_local else torch.empty_like(logits)
        col = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
        valid_col = col < vocab_size
        cdt = _compute_dtype(logits)
        g_logp = torch.zeros(n, dtype=cdt, device=logits.device) if g_logp is None else g_logp.to(cdt)
        g_ent = torch.zeros(n, dtype=cdt, device=logits.device) if g_ent is None else g_ent.to(cdt)
        ops = _ops_module() if with_ops else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            t = targets[s:e]
            if ops is not None:
                if n_valid:  # the ops apply the temperature themselves (in fp32, no scaled copy of the chunk)
                    log_z, h = stats[1, s:e], stats[2, s:e]
                    ops.logprobs_entropy_backward(logits[s:e, :n_valid], t, vocab_start, log_z, h,
                                                  g_logp[s:e].contiguous(), g_ent[s:e].contiguous(),
                                                  temperature=temperature, out=grad[s:e, :n_valid])
                continue
            x = logits[s:e].to(cdt) / temperature
            _, log_z, sum_px = stats[:, s:e]
            p = torch.exp(x - log_z.unsqueeze(-1))
            p = torch.where(valid_col, p, torch.zeros_like(p))
            x0 = torch.where(valid_col, x, torch.zeros_like(x))
            gl, ge = g_logp[s:e].unsqueeze(-1), g_ent[s:e].unsqueeze(-1)
            gx = -p * (gl + ge * (x0 - sum_px.unsqueeze(-1)))
            in_shard = (t >= vocab_start) & (t < vocab_start + v_local)
            local_t = (t - vocab_start).clamp(0, v_local - 1)
            gx.scatter_add_(-1, local_t.unsqueeze(-1), (gl.squeeze(-1) * in_shard).unsqueeze(-1))
            grad[s:e] = (gx / temperature).to(grad.dtype)
        return grad, None, None, None, None, None, None, None, None


IMPLS = ("auto", "ops", "torch")


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    tp_group=None,
    impl: str = "auto",
):
    """Log-prob of ``targets`` and entropy of softmax(logits / temperature), from TP-sharded logits.

    logits: [..., V_padded / TP] (this rank's contiguous vocab shard, megatron's layout); targets: [...] global
    token ids. vocab_size: the true vocab (entries beyond it are padding and masked); None = no padding.
    impl: 'ops' = the per-chunk statistics and backward of ``megatron_ppo.ops`` (kernels, or its torch reference),
    'torch' = this module's own torch path, 'auto' = ops when it imports.
    Returns (log_probs, entropy), both [...] float32 (float64 for float64 logits), differentiable w.r.t. logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: leading dims differ")
    group, rank, world = _tp_info(tp_group)
    v_local = logits.shape[-1]
    vocab_start = rank * v_local
    if vocab_size is None:
        vocab_size = v_local * world
    if vocab_size > v_local * world:
        raise ValueError(f"vocab_size={vocab_size} exceeds the sharded vocab {v_local} x {world}")
    use_ops = impl == "ops" or (impl == "auto" and _ops_module() is not None)
    if use_ops and _ops_module() is None:
        raise RuntimeError("impl='ops' but megatron_ppo.ops (partial_stats, ...) is not importable")
    lead = logits.shape[:-1]
    flat_logits = logits.reshape(-1, v_local)
    flat_targets = targets.reshape(-1).long()
    checks.index_range(flat_targets, "targets", 0, vocab_size)  # read once per call inside checks.deferred()
    logp, ent = _VocabParallelLogprobEntropy.apply(flat_logits, flat_targets, vocab_start, vocab_size,
                                                   float(temperature), int(chunk_size), group, world, use_ops)
    return logp.reshape(lead), ent.reshape(lead)


def next_token_targets(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
    """Targets for causal-LM log-probs: position i predicts token i+1 of the same sequence.

    input_ids: [B, S] (padded; each row one sequence) or [1, T] / [T] packed with ``cu_seqlens`` ([n+1]).
    Returns (targets, valid): valid is False at each sequence's last position (no next token there).
    """
    targets = torch.roll(input_ids, shifts=-1, dims=-1)
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    if cu_seqlens is None:
        valid[..., -1] = False
    else:
        after = torch.arange(1, input_ids.shape[-1] + 1, device=input_ids.device)  # a position's successor
        valid = ~torch.isin(after, cu_seqlens[1:].to(after.dtype)).view_as(input_ids)  # no boolean index: no read
    targets = torch.where(valid, targets, torch.zeros_like(targets))
    return targets, valid
