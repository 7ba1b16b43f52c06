"""Per-token log-prob of the target and entropy from logits, fused: no [N, V] float32 log-softmax is ever built.

The math, per row x = logits / temperature (this rank's vocabulary shard, global max M over all shards):
  S = sum_j exp(x_j - M),  W = sum_j exp(x_j - M)(x_j - M),  log Z = M + log S,
  log p(target) = (x_target - M) - log S,  H = log S - W / S.
Each rank computes (local max, S, W relative to it, target logit or 0) in one pass over its logits
(``partial_stats``); ``rebase_stats`` moves S, W onto the global max, so tensor parallelism costs one MAX and one
SUM all-reduce of [N]-sized tensors (``token_logprobs_entropy(..., tp_group=...)`` does exactly that). The
backward needs only log Z and H per row and no communication, like Megatron's vocab-parallel cross entropy:
  d/dlogit_j = (1/temperature) (-p_j (g_lp + g_H (x_j - log Z + H)) + g_lp [j == target]).
Columns at or beyond ``vocab_size`` (Megatron's vocabulary padding) are left out and get zero gradient.
Outputs are float32 (float64 for float64 logits) whatever the logits dtype; the gradient has the logits dtype.
"""
from __future__ import annotations

import math

import torch

from megatron_ppo.algo import checks
from megatron_ppo.ops import _backend, reference


def _impl(device: torch.device, op: str):
    return _backend.kernels_for(device, op) or reference


def _inv_temperature(temperature) -> float:
    temperature = checks.real_number(temperature, "temperature", low=0.0, low_inclusive=False)
    return 1.0 / temperature


def partial_stats(logits: torch.Tensor, target_ids: torch.Tensor, vocab_start_index: int = 0,
                  temperature: float = 1.0) -> torch.Tensor:
    """[4, N] per-row statistics of a (shard of) logits [N, V_local] divided by ``temperature``: local max M_l,
    sum exp(x - M_l), sum exp(x - M_l)(x - M_l), and the target logit when ``target_ids - vocab_start_index`` falls
    in this shard (else 0). float32 (float64 for float64 logits). No autograd. Pass only the real (unpadded)
    columns of the shard; a shard with none has statistics (-inf, 0, 0, 0)."""
    _check_rows(logits, target_ids)
    inv_t = _inv_temperature(temperature)
    with torch.no_grad():
        if logits.shape[1] == 0:
            return _empty_stats(logits)
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        return _impl(logits.device, "partial_stats").lse_partials(logits, target_ids, int(vocab_start_index), inv_t)


def rebase_stats(stats: torch.Tensor, global_max: torch.Tensor) -> torch.Tensor:
    """[3, N] (sum-exp, sum exp * shifted logit, target logit) of ``partial_stats`` moved from the local max onto
    ``global_max`` (the all-reduced MAX of stats[0]); summing these across TP ranks gives the global statistics."""
    local_max, sum_exp, sum_shifted, target_logit = stats
    shift = local_max - global_max  # <= 0; -inf for a shard row that is all -inf (sum_exp == 0 there)
    scale = torch.exp(shift)
    empty = sum_exp == 0
    zero = torch.zeros_like(sum_exp)
    rebased_sum = torch.where(empty, zero, scale * sum_exp)
    rebased_shifted = torch.where(empty, zero, scale * (sum_shifted + shift * sum_exp))
    return torch.stack([rebased_sum, rebased_shifted, target_logit])


def finish_stats(global_max: torch.Tensor, summed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_probs, entropy, log_normalizer) from the global max and the [3, N] global (rebased, summed) stats."""
    sum_exp, sum_shifted, target_logit = summed
    log_sum = torch.log(sum_exp)
    # (x_t - M) - log S: never rounds M + log S first, which loses digits when logits are large (|x| ~ 1e4).
    log_probs = (target_logit - global_max) - log_sum
    return log_probs, log_sum - sum_shifted / sum_exp, global_max + log_sum


def logprobs_entropy_backward(logits: torch.Tensor, target_ids: torch.Tensor, vocab_start_index: int,
                              log_normalizer: torch.Tensor, entropy: torch.Tensor, grad_log_probs: torch.Tensor,
                              grad_entropy: torch.Tensor, temperature: float = 1.0,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """grad wrt this shard's logits [N, V_local] of sum(grad_log_probs * log_probs + grad_entropy * entropy);
    written into ``out`` when given (may be ``logits`` itself: in-place; rows may be strided)."""
    _check_rows(logits, target_ids)
    inv_t = _inv_temperature(temperature)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    impl = _impl(logits.device, "logprobs_entropy_backward")
    return impl.lse_backward(logits, target_ids, int(vocab_start_index), inv_t, log_normalizer, entropy,
                             grad_log_probs, grad_entropy, out=out)


class _TokenLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_ids, vocab_start_index, n_valid, temperature, tp_group, inplace_backward):
        stats = partial_stats(logits[:, :n_valid], target_ids, vocab_start_index, temperature)
        if tp_group is None:
            global_max, summed = stats[0], stats[1:]
        else:
            import torch.distributed as dist

            global_max = stats[0].clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            summed = rebase_stats(stats, global_max)
            dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=tp_group)
        log_probs, entropy, log_normalizer = finish_stats(global_max, summed)
        ctx.save_for_backward(logits, target_ids, log_normalizer, entropy)
        ctx.config = (vocab_start_index, n_valid, temperature, inplace_backward)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, target_ids, log_normalizer, entropy = ctx.saved_tensors
        vocab_start_index, n_valid, temperature, inplace_backward = ctx.config
        grad_log_probs = torch.zeros_like(entropy) if grad_log_probs is None else grad_log_probs.contiguous()
        grad_entropy = torch.zeros_like(entropy) if grad_entropy is None else grad_entropy.contiguous()
        grad = logits if inplace_backward else torch.empty_like(logits, memory_format=torch.contiguous_format)
        if n_valid < logits.shape[1]:
            grad[:, n_valid:] = 0  # vocabulary padding
        if n_valid > 0:
            logprobs_entropy_backward(logits[:, :n_valid], target_ids, vocab_start_index, log_normalizer, entropy,
                                      grad_log_probs, grad_entropy, temperature, out=grad[:, :n_valid])
        return grad, None, None, None, None, None, None


def token_logprobs_entropy(logits: torch.Tensor, target_ids: torch.Tensor, *, vocab_start_index: int = 0,
                           vocab_size: int | None = None, temperature: float = 1.0, tp_group=None,
                           inplace_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) of softmax(logits / temperature), each shaped ``logits.shape[:-1]``, differentiable
    wrt ``logits``.

    ``logits`` [..., V_local] (bf16/fp32/fp64) is the full vocabulary, or with ``tp_group`` this rank's shard
    starting at global id ``vocab_start_index`` (Megatron's vocab-parallel layout). ``vocab_size`` is the true
    vocabulary when the last columns are padding (left out, zero gradient); None = no padding. ``target_ids`` are
    global ids in [0, vocab_size). ``inplace_backward`` writes the gradient into ``logits`` (saves one [N, V]
    buffer; only when nothing else needs the logits afterwards, as with verl/flash-attn's option of that name).
    """
    checks.float_tensor(logits, "logits", min_ndim=1)
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise ValueError(f"logits must be float32, bfloat16 or float64, got {logits.dtype}")
    if not isinstance(target_ids, torch.Tensor) or target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target_ids must be an int64/int32 tensor, got {getattr(target_ids, 'dtype', target_ids)}")
    if target_ids.shape != logits.shape[:-1]:
        raise ValueError(f"target_ids has shape {tuple(target_ids.shape)}, expected logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])}")
    if target_ids.device != logits.device:
        raise ValueError(f"target_ids is on {target_ids.device} but logits on {logits.device}")
    vocab_local = logits.shape[-1]
    if vocab_local == 0:
        raise ValueError("logits has an empty vocabulary dim")
    vocab_start_index = checks.integer(vocab_start_index, "vocab_start_index", low=0)
    _inv_temperature(temperature)
    if tp_group is None:
        if vocab_start_index != 0:
            raise ValueError("vocab_start_index must be 0 without a tp_group (logits hold the full vocabulary)")
        vocab_padded = vocab_local
    else:
        import torch.distributed as dist

        vocab_padded = vocab_local * dist.get_world_size(group=tp_group)
        if vocab_start_index + vocab_local > vocab_padded:
            raise ValueError(f"vocab_start_index {vocab_start_index} + V_local {vocab_local} exceeds the sharded "
                             f"vocabulary {vocab_padded}")
    if vocab_size is None:
        vocab_size = vocab_padded
    vocab_size = checks.integer(vocab_size, "vocab_size", low=1)
    if vocab_size > vocab_padded:
        raise ValueError(f"vocab_size {vocab_size} exceeds the logits' vocabulary {vocab_padded}")
    _check_target_range(target_ids, vocab_size)
    n_valid = min(max(vocab_size - vocab_start_index, 0), vocab_local)

    lead_shape = logits.shape[:-1]
    logits2d = logits.reshape(-1, vocab_local)
    if logits2d.stride(-1) != 1:
        logits2d = logits2d.contiguous()
    targets = target_ids.reshape(-1).to(torch.int64).contiguous()
    log_probs, entropy = _TokenLogprobsEntropy.apply(logits2d, targets, vocab_start_index, n_valid,
                                                      float(temperature), tp_group, bool(inplace_backward))
    return log_probs.view(lead_shape), entropy.view(lead_shape)


def _empty_stats(logits: torch.Tensor) -> torch.Tensor:
    stats = torch.zeros(4, logits.shape[0], dtype=reference.stats_dtype(logits.dtype), device=logits.device)
    stats[0] = -math.inf
    return stats


def _check_rows(logits: torch.Tensor, target_ids: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V_local], got shape {tuple(logits.shape)}")
    if target_ids.dim() != 1 or target_ids.shape[0] != logits.shape[0] or target_ids.dtype != torch.int64:
        raise ValueError(f"target_ids must be int64 [N={logits.shape[0]}], got {target_ids.dtype} "
                         f"{tuple(target_ids.shape)}")


def _check_target_range(target_ids: torch.Tensor, vocab_size: int) -> None:
    if not checks.value_checks_enabled() or target_ids.numel() == 0:
        return
    bad = (target_ids < 0) | (target_ids >= vocab_size)
    if bool(bad.any()):
        first = target_ids[bad].flatten()[0].item()
        raise ValueError(f"target_ids must lie in [0, {vocab_size}) (the vocabulary size); got {first} "
                         f"in {int(bad.sum())} positions")
