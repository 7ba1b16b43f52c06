"""Advantage estimators (GAE, GRPO outcome) and masked statistics.

verl 0.9.1 counterparts: ``verl.trainer.ppo.core_algos.compute_gae_advantage_return`` /
``compute_grpo_outcome_advantage`` and ``verl.utils.torch_functional.masked_{mean,var,whiten}``.
Deviations (all documented in docs/algo.md): GAE is returned un-whitened and zeroed at masked positions,
inputs at masked positions are ignored (NaN there is harmless), statistics over fewer than 2 valid tokens have
a defined value instead of an exception, masks must be 0/1.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_ppo.algo import checks

WHITEN_EPS = 1e-8  # verl's variance floor inside masked_whiten


# ---------------------------------------------------------------------------------------------------------------
# masked statistics: the plain names validate their inputs; the *_unchecked ones are the math alone (a bool mask
# already checked by the caller, no checks, no host sync), shared with the other algo modules


def masked_sum_unchecked(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    summed = torch.where(mask, values, zero)
    return summed.sum() if axis is None else summed.sum(dim=axis)


def masked_mean_unchecked(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum_unchecked(values, mask, axis) / count.to(values.dtype).clamp_min(1)


def masked_var_unchecked(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean_unchecked(values, mask)
    var = masked_mean_unchecked((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum().to(values.dtype)
        # Bessel's correction; with fewer than 2 valid values the unbiased variance is undefined -> 0 (documented).
        var = torch.where(count >= 2, var * count / (count - 1).clamp_min(1), torch.zeros_like(var))
    return var


def masked_whiten_unchecked(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    mean = masked_mean_unchecked(values, mask)
    var = masked_var_unchecked(values, mask, unbiased=True)
    count = mask.sum()
    # Fewer than 2 valid values: no spread to divide by, so only centre (scale 1). Branch-free: no host sync.
    scale = torch.where(count >= 2, torch.rsqrt(var + WHITEN_EPS), torch.ones_like(var))
    whitened = (values - mean) * scale
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _check_values_mask(values, mask, values_name: str = "values", mask_name: str = "mask"):
    checks.float_tensor(values, values_name)
    m = checks.mask(mask, mask_name, values_name, values)
    checks.finite(values, values_name, m)
    return m


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (values elsewhere, even NaN, are ignored)."""
    return masked_sum_unchecked(values, _check_values_mask(values, mask), axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis=None) -> torch.Tensor:
    """Mean over valid positions; 0 where there are none (verl: same, via its +1e-8 denominator)."""
    return masked_mean_unchecked(values, _check_values_mask(values, mask), axis)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid positions. Unbiased with < 2 valid values: 0 (verl raises ValueError)."""
    return masked_var_unchecked(values, _check_values_mask(values, mask), unbiased)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with masked statistics; applied to every position like verl.

    With fewer than 2 valid values the variance is undefined: the result is only centred (``values - mean``,
    scale 1; with 0 valid values mean = 0 so ``values`` come back unchanged). verl raises in that case.
    """
    return masked_whiten_unchecked(values, _check_values_mask(values, mask), shift_mean)


# ---------------------------------------------------------------------------------------------------------------
# GAE


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [batch, response_length]; returns (advantages, returns), UN-whitened.

    verl's reverse recursion: at masked positions inside a response (e.g. tool/observation tokens) the TD step is
    skipped, so ``nextvalues`` and ``lastgaelam`` carry over them. Then advantages and returns are set to 0 at
    masked positions (verl leaves the carried value there) and returns = advantages + values at valid ones.
    Whitening is the caller's choice (``masked_whiten``); verl whitens inside. Inputs at masked positions are
    ignored. gamma and lam must lie in [0, 1].
    """
    checks.float_tensor(token_level_rewards, "token_level_rewards", ndim=2)
    checks.float_like(values, "values", "token_level_rewards", token_level_rewards)
    mask = checks.mask(response_mask, "response_mask", "token_level_rewards", token_level_rewards)
    gamma = checks.real_number(gamma, "gamma", low=0.0, high=1.0)
    lam = checks.real_number(lam, "lam", low=0.0, high=1.0)
    checks.finite(token_level_rewards, "token_level_rewards", mask)
    checks.finite(values, "values", mask)

    with torch.no_grad():
        dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
        rewards, vals = token_level_rewards.to(dtype), values.to(dtype)
        batch, length = rewards.shape
        advantages = torch.zeros((batch, length), dtype=dtype, device=rewards.device)
        next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
        last_gae = torch.zeros(batch, dtype=dtype, device=rewards.device)
        for t in reversed(range(length)):
            valid = mask[:, t]
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            # torch.where (not verl's multiply-by-mask) so NaN/garbage at masked positions cannot leak in.
            last_gae = torch.where(valid, delta + gamma * lam * last_gae, last_gae)
            next_value = torch.where(valid, vals[:, t], next_value)
            advantages[:, t] = last_gae
        zero = torch.zeros((), dtype=dtype, device=rewards.device)
        advantages = torch.where(mask, advantages, zero)
        returns = torch.where(mask, advantages + vals, zero)
    return advantages, returns


# ---------------------------------------------------------------------------------------------------------------
# GRPO


def _group_ids(index, batch: int, device) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group labels (uids, prompt ids) to 0..G-1, in order of first appearance."""
    if isinstance(index, torch.Tensor):
        labels = index.reshape(-1).tolist()
    elif isinstance(index, np.ndarray):
        labels = index.reshape(-1).tolist()
    elif isinstance(index, Sequence) and not isinstance(index, str | bytes):
        labels = list(index)
    else:
        raise ValueError(f"index must be a sequence/array of group labels, got {type(index).__name__}")
    if len(labels) != batch:
        raise ValueError(f"index has {len(labels)} entries but token_level_rewards has {batch} rows")
    ids: dict = {}
    try:
        gid = [ids.setdefault(label, len(ids)) for label in labels]
    except TypeError as exc:
        raise ValueError(f"index labels must be hashable: {exc}") from None
    return torch.tensor(gid, dtype=torch.long, device=device), len(ids)


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: per response score = sum of its rewards, normalised within its group.

    ``index[i]`` is the group label (e.g. prompt uid) of row i. advantage_i = (s_i - mean_g) / (std_g + epsilon)
    (Dr.GRPO: ``norm_adv_by_std_in_grpo=False`` -> s_i - mean_g; epsilon must be > 0 when dividing), broadcast over valid tokens, 0 elsewhere.
    std is the unbiased (n-1) group std like verl's torch.std. Groups of size 1 follow verl: mean 0 and std 1,
    so a lone response gets s_i / (1 + epsilon). Scores sum rewards at valid positions only (verl sums the whole
    row; identical whenever rewards outside the mask are 0, as they are in practice). Returns (advantages,
    returns), which are the same tensor here, as in verl.
    """
    checks.float_tensor(token_level_rewards, "token_level_rewards", ndim=2)
    mask = checks.mask(response_mask, "response_mask", "token_level_rewards", token_level_rewards)
    # epsilon > 0 when dividing by std: a group of equal scores has std 0 (or rounding noise) -> 0/0 or noise/noise
    epsilon = checks.real_number(epsilon, "epsilon", low=0.0, low_inclusive=not norm_adv_by_std_in_grpo)
    checks.finite(token_level_rewards, "token_level_rewards", mask)
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)

    with torch.no_grad():
        scores = masked_sum_unchecked(token_level_rewards, mask, axis=-1)
        dtype, device = scores.dtype, scores.device
        count = torch.zeros(n_groups, dtype=dtype, device=device).index_add_(0, gid, torch.ones_like(scores))
        mean = torch.zeros(n_groups, dtype=dtype, device=device).index_add_(0, gid, scores) / count.clamp_min(1)
        sq_dev = (scores - mean[gid]) ** 2
        var = torch.zeros(n_groups, dtype=dtype, device=device).index_add_(0, gid, sq_dev) / (count - 1).clamp_min(1)
        singleton = count < 2
        mean = torch.where(singleton, torch.zeros_like(mean), mean)
        std = torch.where(singleton, torch.ones_like(var), var.sqrt())
        centred = scores - mean[gid]
        scalars = centred / (std[gid] + epsilon) if norm_adv_by_std_in_grpo else centred
        advantages = torch.where(mask, scalars.unsqueeze(-1), torch.zeros((), dtype=dtype, device=device))
    return advantages, advantages
