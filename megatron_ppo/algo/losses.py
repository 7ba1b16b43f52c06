"""PPO losses and their pieces: loss aggregation, clipped policy / value losses, entropy, KL estimators.

verl 0.9.1 counterparts live in ``verl.trainer.ppo.core_algos`` (agg_loss, compute_policy_loss_vanilla,
compute_policy_loss_reinforce, compute_policy_loss_bypass_mode, compute_value_loss, kl_penalty) and ``verl.utils.torch_functional`` (entropy_from_logits[_with_chunking]).
Differences are listed in docs/algo.md; the main ones: no NaN from empty masks (the loss is 0), inputs at masked
positions are ignored, metric values are detached 0-dim tensors (no host sync per micro-batch; ``float(v)``).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from megatron_ppo.algo import checks
from megatron_ppo.algo.advantages import masked_mean_unchecked, masked_sum_unchecked, masked_var_unchecked
from megatron_ppo.algo.rollout_correction import bypass_correction

AGG_LOSS_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")  # algorithm.rollout_correction.loss_type
KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOG_RATIO_CLAMP = 20.0  # verl clamps log-ratios to +-20 before exp (ratio, k3)
K3_CLAMP = 10.0  # verl clamps the k3 estimate to +-10


# ---------------------------------------------------------------------------------------------------------------
# aggregation


def _agg_loss(loss_mat, mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("batch_num_tokens (valid tokens in the global batch) is required when dp_size > 1")
            batch_num_tokens = mask.sum().to(loss_mat.dtype)
        denom = batch_num_tokens.clamp_min(1) if isinstance(batch_num_tokens, torch.Tensor) else max(batch_num_tokens, 1)
        return masked_sum_unchecked(loss_mat, mask) / denom * dp_size
    if loss_agg_mode == "token-sum":
        # DP ranks average gradients; scaling by dp_size makes that the global token sum.
        return masked_sum_unchecked(loss_mat, mask) * dp_size
    seq_valid = mask.any(dim=-1)
    seq_losses = masked_sum_unchecked(loss_mat, mask, axis=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / mask.sum(dim=-1).to(loss_mat.dtype).clamp_min(1)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size (sequences in the global batch) is required when dp_size > 1")
        global_batch_size = seq_valid.sum().to(loss_mat.dtype)
    denom = global_batch_size.clamp_min(1) if isinstance(global_batch_size, torch.Tensor) else max(global_batch_size, 1)
    loss = masked_sum_unchecked(seq_losses, seq_valid) / denom * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor if loss_scale_factor is not None else max(mask.shape[-1], 1))
    return loss


def _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor):
    checks.choice(loss_agg_mode, "loss_agg_mode", AGG_LOSS_MODES)
    dp_size = checks.integer(dp_size, "dp_size", low=1)
    if batch_num_tokens is not None:
        batch_num_tokens = checks.real_number(batch_num_tokens, "batch_num_tokens", low=0.0)
    if global_batch_size is not None:
        global_batch_size = checks.real_number(global_batch_size, "global_batch_size", low=0.0)
    if loss_scale_factor is not None:
        loss_scale_factor = checks.real_number(loss_scale_factor, "loss_scale_factor", low=0.0, low_inclusive=False)
    return dp_size, batch_num_tokens, global_batch_size, loss_scale_factor


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a [batch, length] loss matrix to a scalar, invariant to how the global batch is split.

    Modes as verl: token-mean (sum / tokens), token-sum, seq-mean-token-sum, seq-mean-token-mean and
    seq-mean-token-sum-norm (seq-mean-token-sum / loss_scale_factor, default the padded length
    ``loss_mask.shape[-1]``; pass a constant, e.g. max_response_length, for a fixed scale). Rows with no valid
    token do not count as sequences. With data parallelism pass ``dp_size`` and the GLOBAL ``batch_num_tokens``
    (token-mean) or ``global_batch_size`` (seq-mean modes): each rank's loss is its share of the global
    average times dp_size, so the DP gradient average gives the global value. Without them the local
    micro-batch is the normaliser. An empty mask (or a global count of 0) gives 0, not verl's NaN.
    """
    checks.float_tensor(loss_mat, "loss_mat", ndim=2)
    mask = checks.mask(loss_mask, "loss_mask", "loss_mat", loss_mat)
    args = _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    loss = _agg_loss(loss_mat, mask, loss_agg_mode, *args)
    checks.finite_via(loss, loss_mat, "loss_mat", mask)  # every valid element is summed into loss: fused check
    return loss


# ---------------------------------------------------------------------------------------------------------------
# policy loss


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual-clip (verl's "vanilla" policy loss).

    ratio = exp(clamp(log_prob - old_log_prob, +-20)); per token loss = max(-A*ratio, -A*clip(ratio, 1-low,
    1+high)), and for A < 0 additionally capped at -A*clip_ratio_c (dual-clip, clip_ratio_c > 1). Optional
    ``rollout_is_weights`` (detached) multiply the per-token losses before aggregation (see ``agg_loss`` for the
    aggregation arguments). Returns (loss, metrics) with metrics actor/pg_loss, actor/pg_clipfrac,
    actor/pg_clipfrac_lower, actor/ppo_kl as detached 0-dim tensors.
    """
    checks.float_tensor(log_prob, "log_prob", ndim=2)
    checks.float_like(old_log_prob, "old_log_prob", "log_prob", log_prob)
    checks.float_like(advantages, "advantages", "log_prob", log_prob)
    mask = checks.mask(response_mask, "response_mask", "log_prob", log_prob)
    low = checks.real_number(clip_ratio_low if clip_ratio_low is not None else clip_ratio, "clip_ratio_low",
                             low=0.0, high=1.0)
    high = checks.real_number(clip_ratio_high if clip_ratio_high is not None else clip_ratio, "clip_ratio_high",
                              low=0.0)
    clip_ratio_c = checks.real_number(clip_ratio_c, "clip_ratio_c", low=1.0, low_inclusive=False, allow_inf=True)
    agg_args = _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    for name, tensor in (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages)):
        checks.finite(tensor, name, mask)
    if rollout_is_weights is not None:
        checks.float_like(rollout_is_weights, "rollout_is_weights", "log_prob", log_prob)
        checks.finite(rollout_is_weights, "rollout_is_weights", mask)
        checks.nonnegative(rollout_is_weights, "rollout_is_weights", mask)

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    losses_ppo = torch.maximum(losses_unclipped, losses_clipped)
    losses_dual = -advantages * clip_ratio_c  # caps the loss of negative-advantage tokens with huge ratios
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(losses_dual, losses_ppo), losses_ppo)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = _agg_loss(pg_losses, mask, loss_agg_mode, *agg_args)

    with torch.no_grad():
        dtype = log_prob.dtype
        metrics = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": masked_mean_unchecked((losses_clipped > losses_unclipped).to(dtype), mask),
            "actor/pg_clipfrac_lower": masked_mean_unchecked(((losses_ppo > losses_dual) & negative).to(dtype), mask),
            "actor/ppo_kl": masked_mean_unchecked(-log_ratio.detach(), mask),
        }
    return loss, metrics


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with optional IS correction (verl's compute_policy_loss_reinforce): per token
    -A * log_prob * w (w detached, 1 without weights), no ratio and no clipping. Metrics: actor/pg_loss,
    actor/ppo_kl (mean of rollout_log_prob - log_prob, unclamped, as verl)."""
    checks.float_tensor(log_prob, "log_prob", ndim=2)
    checks.float_like(rollout_log_prob, "rollout_log_prob", "log_prob", log_prob)
    checks.float_like(advantages, "advantages", "log_prob", log_prob)
    mask = checks.mask(response_mask, "response_mask", "log_prob", log_prob)
    agg_args = _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    for name, tensor in (("log_prob", log_prob), ("rollout_log_prob", rollout_log_prob), ("advantages", advantages)):
        checks.finite(tensor, name, mask)
    pg_losses = -advantages * log_prob
    if rollout_is_weights is not None:
        checks.float_like(rollout_is_weights, "rollout_is_weights", "log_prob", log_prob)
        checks.finite(rollout_is_weights, "rollout_is_weights", mask)
        checks.nonnegative(rollout_is_weights, "rollout_is_weights", mask)
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = _agg_loss(pg_losses, mask, loss_agg_mode, *agg_args)
    with torch.no_grad():
        metrics = {"actor/pg_loss": loss.detach(),
                   "actor/ppo_kl": masked_mean_unchecked(rollout_log_prob - log_prob.detach(), mask)}
    return loss, metrics


def compute_policy_loss_bypass(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode's policy loss (verl's compute_policy_loss_bypass_mode): old log-probs ARE the rollout's, so
    no recompute; IS weights and the rejection mask are computed here from the current ``log_prob`` (detached).

    "ppo_clip": ``compute_policy_loss`` with ratio pi_current / pi_rollout on the rejection-masked tokens and NO
    IS weights (the clipped ratio already is the correction; weights would count it twice: with ``rollout_is``
    set they are metrics only). "reinforce": ``compute_policy_loss_reinforce`` with the IS weights (if
    ``rollout_is``). The normalisers (``batch_num_tokens`` ...) stay those of the unrejected mini-batch, as in
    verl. Metrics: the loss's plus ``rollout_corr/*`` of ``rollout_correction.bypass_correction``.
    """
    checks.choice(loss_type, "loss_type", BYPASS_LOSS_TYPES)
    weights, effective_mask, rc_metrics = bypass_correction(
        log_prob, rollout_log_prob, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize,
        rollout_rs, rollout_rs_threshold)
    agg = dict(loss_agg_mode=loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
               global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
    if loss_type == "reinforce":
        loss, metrics = compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, effective_mask,
                                                      rollout_is_weights=weights, **agg)
    else:
        loss, metrics = compute_policy_loss(rollout_log_prob, log_prob, advantages, effective_mask,
                                            clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                                            clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, **agg)
    return loss, {**metrics, **rc_metrics}


# ---------------------------------------------------------------------------------------------------------------
# value loss


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)); returns (loss, clipfrac).

    ``values`` are the old (rollout-time) values, ``vpreds`` the current ones. clipfrac (detached) is the share of
    valid tokens where the clipped term is the larger one.
    """
    checks.float_tensor(vpreds, "vpreds", ndim=2)
    checks.float_like(returns, "returns", "vpreds", vpreds)
    checks.float_like(values, "values", "vpreds", vpreds)
    mask = checks.mask(response_mask, "response_mask", "vpreds", vpreds)
    clip = checks.real_number(cliprange_value, "cliprange_value", low=0.0, allow_inf=True)
    agg_args = _check_agg_args(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    for name, tensor in (("vpreds", vpreds), ("returns", returns), ("values", values)):
        checks.finite(tensor, name, mask)

    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + clip), values - clip)
    losses_unclipped = (vpreds - returns) ** 2
    losses_clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * _agg_loss(torch.maximum(losses_unclipped, losses_clipped), mask, loss_agg_mode, *agg_args)
    with torch.no_grad():
        clipfrac = masked_mean_unchecked((losses_clipped > losses_unclipped).to(vpreds.dtype), mask)
    return loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """critic/vf_explained_var: 1 - Var(returns - values) / (Var(returns) + 1e-5) over valid tokens (verl's
    metric_utils formula, unbiased variances). Fewer than 2 valid tokens: 0 (verl gives NaN)."""
    checks.float_tensor(values, "values", ndim=2)
    checks.float_like(returns, "returns", "values", values)
    mask = checks.mask(response_mask, "response_mask", "values", values)
    checks.finite(values, "values", mask)
    checks.finite(returns, "returns", mask)
    with torch.no_grad():
        ev = 1.0 - masked_var_unchecked(returns - values, mask) / (masked_var_unchecked(returns, mask) + 1e-5)
        return torch.where(mask.sum() >= 2, ev, torch.zeros_like(ev))


# ---------------------------------------------------------------------------------------------------------------
# entropy


def _check_entropy(logits: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    # Checking the [N] result instead of the [N, V] logits keeps the check cheap; NaN/inf logits show up here.
    checks.finite(entropy, "logits (entropy is NaN/inf: logits contain NaN/inf; -inf masking is not supported)")
    return entropy


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(softmax(z) * z) (verl's formula)."""
    checks.float_tensor(logits, "logits", min_ndim=1)
    probs = torch.softmax(logits, dim=-1)
    return _check_entropy(logits, torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy row-chunk by row-chunk; backward recomputes softmax per chunk, so neither pass holds more than
    chunk_size x vocab temporaries (autograd through the plain formula would keep the whole softmax)."""

    @staticmethod
    def forward(ctx, logits2d: torch.Tensor, chunk_size: int) -> torch.Tensor:
        dtype = _compute_dtype(logits2d.dtype)
        out = torch.empty(logits2d.shape[0], dtype=dtype, device=logits2d.device)
        for start in range(0, logits2d.shape[0], chunk_size):
            z = logits2d[start:start + chunk_size].to(dtype)
            out[start:start + chunk_size] = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits2d)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (logits2d,) = ctx.saved_tensors
        dtype = _compute_dtype(logits2d.dtype)
        grad = torch.empty_like(logits2d)
        for start in range(0, logits2d.shape[0], ctx.chunk_size):
            z = logits2d[start:start + ctx.chunk_size].to(dtype)
            p = torch.softmax(z, dim=-1)
            mean_z = (p * z).sum(-1, keepdim=True)
            # dH/dz_j = -p_j * (z_j - sum_i p_i z_i)
            g = grad_out[start:start + ctx.chunk_size].to(dtype).unsqueeze(-1)
            grad[start:start + ctx.chunk_size] = (-p * (z - mean_z) * g).to(logits2d.dtype)
        return grad, None


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """``entropy_from_logits`` with memory bounded by chunk_size x vocab in forward AND backward.

    Works on [..., V]; computes in float32 (float64 for float64 logits) and returns that dtype, like verl's
    variant (which always returns float32). Gradients are exact (closed form), once-differentiable.
    """
    checks.float_tensor(logits, "logits", min_ndim=1)
    chunk_size = checks.integer(chunk_size, "chunk_size", low=1)
    flat = logits.reshape(-1, logits.shape[-1])
    entropy = _ChunkedEntropy.apply(flat, chunk_size).reshape(logits.shape[:-1])
    return _check_entropy(logits, entropy)


# ---------------------------------------------------------------------------------------------------------------
# KL estimators


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    # low_var_kl / k3 (Schulman, "Approximating KL divergence"): r - log r - 1 with r = p_ref / p, with verl's clamps
    log_r = torch.clamp(ref_logprob - logprob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_r) - log_r - 1, min=-K3_CLAMP, max=K3_CLAMP)


def parse_kl_type(kl_penalty) -> tuple[str, bool]:
    """"k3+" -> ("k3", True): the estimator and whether the straight-through (k2-gradient) variant is asked."""
    if not isinstance(kl_penalty, str):
        raise ValueError(f"kl_penalty must be a string, got {kl_penalty!r}")
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    if base not in KL_PENALTY_TYPES:
        raise ValueError(f"kl_penalty must be one of {list(KL_PENALTY_TYPES)} (optionally with a '+' suffix), "
                         f"got {kl_penalty!r}")
    return base, straight_through


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    kl_penalty: str,
    *,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate: "kl"/"k1", "abs", "mse"/"k2", "low_var_kl"/"k3".

    A trailing "+" (e.g. "k3+") is verl's straight-through variant: the forward value of the named estimator
    with the gradient of k2 (0.5 * (logprob - ref_logprob)^2), whose gradient is the unbiased KL gradient.
    ``response_mask`` (optional) only limits the NaN/inf input check to valid positions.
    """
    base, straight_through = parse_kl_type(kl_penalty)
    checks.float_tensor(logprob, "logprob")
    checks.float_like(ref_logprob, "ref_logprob", "logprob", logprob)
    valid = None if response_mask is None else checks.mask(response_mask, "response_mask", "logprob", logprob)
    checks.finite(logprob, "logprob", valid)
    checks.finite(ref_logprob, "ref_logprob", valid)

    forward = kl_estimate(logprob, ref_logprob, base)
    if not straight_through:
        return forward
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()
