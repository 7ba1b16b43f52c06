"""Rollout correction: importance-sampling (IS) weights and rejection masks for off-policy rollouts.

The rollout engine's policy (behaviour, ``rollout_log_prob``) differs from the trained one (``old_log_prob``):
other numerics (bf16 inference vs fp32 training), stale weights, offline trajectories. This module follows
verl 0.9.1's ``verl/trainer/ppo/rollout_corr_helper.py``: same options, threshold syntax, semantics and metric
names (``rollout_corr/rollout_is_mean``, ``..._eff_sample_size``, ``rollout_corr/rollout_rs_masked_fraction``,
``rollout_corr/kl``, ...). Differences (docs/algo.md): batch normalisation is over the tensor given (the driver
holds the whole batch; verl all-reduces when torch.distributed is up), a degenerate ESS (all weights 0) is 0
instead of a ZeroDivisionError, masks must be 0/1, metrics are read back to the host in one transfer.

log_ratio everywhere is log(pi_train / pi_rollout) = old_log_prob - rollout_log_prob, per token.
"""
from __future__ import annotations

import math

import torch

from megatron_ppo.algo import checks
from megatron_ppo.algo.advantages import masked_mean_unchecked, masked_sum_unchecked

SAFETY_BOUND = 20.0  # log-space clamp before exp, as verl
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
METRIC_PREFIX = "rollout_corr/"


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _to_floats(metrics: dict) -> dict[str, float]:
    """One device->host transfer for all tensor metrics."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    if keys:
        values = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in keys]).tolist()
        metrics = {**metrics, **dict(zip(keys, values, strict=True))}
    return {k: float(v) for k, v in metrics.items()}


def _check_log_ratio(log_ratio, response_mask) -> torch.Tensor:
    checks.float_tensor(log_ratio, "log_ratio", ndim=2)
    mask = checks.mask(response_mask, "response_mask", "log_ratio", log_ratio)
    _require_valid_token(mask)
    checks.finite(log_ratio, "log_ratio", mask)
    return mask


def _require_valid_token(mask: torch.Tensor) -> None:
    if not bool(mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1)")


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask, float("-inf")).max()


def _masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~mask, float("inf")).min()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Population std of values clamped to [low, high] (verl's outlier-robust std); 0 with < 2 valid tokens."""
    clamped = values.clamp(min=low, max=high)
    mean = masked_mean_unchecked(clamped, mask)
    std = torch.sqrt(torch.clamp(masked_mean_unchecked(clamped.square(), mask) - mean.square(), min=0.0))
    return torch.where(mask.sum() > 1, std, torch.zeros_like(std))


def _std(values: torch.Tensor) -> torch.Tensor:
    return values.std() if values.numel() > 1 else torch.zeros((), dtype=values.dtype, device=values.device)


def _frac(flags: torch.Tensor) -> torch.Tensor:
    return flags.to(torch.float32).mean()


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """rollout_is_threshold: a number or "U" -> truncate at U (TIS); "L_U" -> zero weights outside [L, U]
    (IcePop). Returns (upper, lower or None)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"rollout_is_threshold must be a number or a 'upper' / 'lower_upper' string, got {spec!r}")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        if "_" in text:
            lower_text, text = text.split("_", 1)
            lower = _parse_float(lower_text, "rollout_is_threshold", spec)
        upper = _parse_float(text, "rollout_is_threshold", spec)
    else:
        upper = float(spec)
    if not (upper > 0) or math.isinf(upper):
        raise ValueError(f"rollout_is_threshold upper bound must be positive and finite, got {upper}")
    if lower is not None and not (0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold lower bound must be positive and <= upper ({upper}), got {lower}")
    return upper, lower


def _parse_float(text: str, name: str, spec) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}: cannot parse {spec!r} as a number") from None
    if math.isnan(value):
        raise ValueError(f"{name}: NaN in {spec!r}")
    return value


def parse_rs_options(rollout_rs) -> list[str]:
    """Comma-separated rejection options, de-duplicated in order; every one must pass for a token to stay."""
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of {list(RS_OPTIONS)}, got {rollout_rs!r}")
    options: list[str] = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if not opt:
            continue
        checks.choice(opt, "rollout_rs", RS_OPTIONS)
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError(f"rollout_rs must name at least one of {list(RS_OPTIONS)}, got {rollout_rs!r}")
    return options


def parse_rs_thresholds(options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """rollout_rs_threshold: one entry shared by all options or one per option (comma separated).
    k1 options take "L_U" ratio bounds (a single U means [1/U, U]); k2/k3 options a single upper bound.
    Returns {option: (lower or None, upper)}."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be given when rollout_rs is set")
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise ValueError(f"rollout_rs_threshold has {len(parts)} entries; give 1 or {len(options)} (one per "
                         f"rollout_rs option {options})")
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts, strict=True):
        name = f"rollout_rs_threshold[{option}]"
        if option.endswith("k1"):
            lower_text, upper_text = part.split("_", 1) if "_" in part else (None, part)
            upper = _parse_float(upper_text, name, part)
            lower = _parse_float(lower_text, name, part) if lower_text is not None else (
                1.0 / upper if upper > 0 else upper)
            if lower <= 0 or upper <= 0 or lower > upper:
                raise ValueError(f"{name} must satisfy 0 < lower <= upper, got {part!r}")
            out[option] = (lower, upper)
        else:
            if "_" in part:
                raise ValueError(f"{name} takes a single upper bound (no '_'), got {part!r}")
            upper = _parse_float(part, name, part)
            if upper <= 0:
                raise ValueError(f"{name} must be positive, got {part!r}")
            out[option] = (None, upper)
    return out


# ---------------------------------------------------------------------------------------------------------------
# IS weights


def _is_metrics(weights, raw, log_ratio_for_metrics, mask, level, upper, lower) -> dict:
    lower = 1.0 / upper if lower is None else lower
    log_upper, log_lower = math.log(upper), math.log(lower)
    m: dict = {}
    if level == "sequence":
        # per-sequence log-weights (all rows, as verl): unclamped min, max clamped at the safety bound
        m["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min())
        m["rollout_is_mean"] = masked_mean_unchecked(weights, mask)
        m["rollout_is_ratio_fraction_high"] = _frac(log_ratio_for_metrics > log_upper)
        m["rollout_is_ratio_fraction_low"] = _frac(log_ratio_for_metrics < log_lower)
    else:
        m["rollout_is_mean"] = masked_mean_unchecked(weights, mask)
        m["rollout_is_ratio_fraction_high"] = masked_mean_unchecked((raw > upper).to(weights.dtype), mask)
        m["rollout_is_ratio_fraction_low"] = masked_mean_unchecked((raw < lower).to(weights.dtype), mask)
        m["rollout_is_max"] = _masked_max(weights, mask)
        m["rollout_is_min"] = _masked_min(weights, mask)
    m["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    # Effective sample size as a fraction of the tokens: 1 / E[(w / E[w])^2]; all-zero weights -> 0.
    clamped = weights.clamp(min=0.0, max=upper)
    second_moment = masked_mean_unchecked((clamped / (masked_mean_unchecked(clamped, mask) + 1e-8)).square(), mask)
    m["rollout_is_eff_sample_size"] = torch.where(second_moment > 0, 1.0 / second_moment,
                                                  torch.zeros_like(second_moment))
    seq_mean = masked_mean_unchecked(weights, mask, axis=-1)
    m["rollout_is_seq_mean"] = seq_mean.mean()
    m["rollout_is_seq_std"] = _std(seq_mean)
    m["rollout_is_seq_max"] = seq_mean.max()
    m["rollout_is_seq_min"] = seq_mean.min()
    m["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max()
    # from the raw per-sequence means: truncated weights can never exceed the threshold
    raw_seq_mean = masked_mean_unchecked(raw, mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = _frac(raw_seq_mean > upper)
    m["rollout_is_seq_fraction_low"] = _frac(raw_seq_mean < lower)
    return m


def _rollout_correction_weights(log_ratio, mask, rollout_is, threshold, batch_normalize):
    upper, lower = parse_is_threshold(threshold)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    with torch.no_grad():
        if rollout_is == "token":
            log_ratio_for_metrics = log_ratio
            raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        else:  # one weight per sequence: the product of its token ratios
            log_ratio_for_metrics = masked_sum_unchecked(log_ratio, mask, axis=-1).unsqueeze(-1)
            raw = torch.exp(torch.clamp(log_ratio_for_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND))
            raw = raw.expand_as(log_ratio)
        raw = torch.where(mask, raw, zero)
        if lower is None:  # truncated IS
            weights = raw.clamp(max=upper)
        else:  # IcePop: drop weights outside [lower, upper]
            weights = torch.where((raw >= lower) & (raw <= upper), raw, zero)
        metrics = _is_metrics(weights, raw, log_ratio_for_metrics, mask, rollout_is, upper, lower)
        if lower is not None:
            metrics["rollout_is_oob_ratio"] = masked_mean_unchecked(((raw < lower) | (raw > upper)).to(raw.dtype), mask)
        if batch_normalize:  # mean weight 1 over tokens (token level) or over sequences (sequence level)
            if rollout_is == "token":
                mean = masked_mean_unchecked(weights, mask)
            else:
                mean = masked_mean_unchecked(masked_mean_unchecked(weights, mask, axis=-1), mask.any(dim=-1))
            factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
            weights = weights / factor
            metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached IS weights pi_train / pi_rollout, 0 at masked positions, and their metrics (unprefixed names).

    rollout_is="token": exp(log_ratio) per token; "sequence": exp(sum of the row's log_ratio) on every token of
    the row. Log-ratios are clamped to +-20 before exp. Threshold: a number U truncates at U (TIS, default 2.0);
    "L_U" zeroes weights outside [L, U] (IcePop). ``rollout_is_batch_normalize`` rescales to mean 1 (over valid
    tokens, or over sequences for the sequence level); metrics describe the weights before that rescaling.
    """
    mask = _check_log_ratio(log_ratio, response_mask)
    checks.choice(rollout_is, "rollout_is", IS_LEVELS)
    weights, metrics = _rollout_correction_weights(log_ratio, mask, rollout_is, rollout_is_threshold,
                                                   bool(rollout_is_batch_normalize))
    return weights, _to_floats(metrics)


# ---------------------------------------------------------------------------------------------------------------
# rejection


def _rs_metrics(option, stat, mask, seq_valid, level, seq_stat, upper, lower, apply_lower) -> dict:
    prefix = f"rollout_rs_{option}"
    dtype = stat.dtype
    seq_values = seq_stat if seq_stat is not None else masked_mean_unchecked(stat, mask, axis=-1)
    seq_values = seq_values[seq_valid]
    m: dict = {f"{prefix}_mean": masked_mean_unchecked(stat, mask)}
    if level == "sequence":
        m[f"{prefix}_max"], m[f"{prefix}_min"] = seq_values.max(), seq_values.min()
        high = _frac(seq_values > upper)
        low = _frac(seq_values < lower) if apply_lower else 0.0
    else:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = _masked_max(stat, mask), _masked_min(stat, mask)
        high = masked_mean_unchecked((stat > upper).to(dtype), mask)
        low = masked_mean_unchecked((stat < lower).to(dtype), mask) if apply_lower else 0.0
    m[f"{prefix}_fraction_high"], m[f"{prefix}_fraction_low"] = high, low
    m[f"{prefix}_std"] = _clamped_std(stat, mask, lower if apply_lower else 0.0, upper)
    m[f"{prefix}_seq_mean"] = seq_values.mean()
    m[f"{prefix}_seq_std"] = _std(seq_values)
    m[f"{prefix}_seq_max"] = seq_values.max()
    m[f"{prefix}_seq_min"] = seq_values.min()
    m[f"{prefix}_seq_max_deviation"] = seq_values.abs().max()
    m[f"{prefix}_seq_fraction_high"] = _frac(seq_values > upper)
    if apply_lower:
        m[f"{prefix}_seq_fraction_low"] = _frac(seq_values < lower)
    return m


def _rejection_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold):
    options = parse_rs_options(rollout_rs)
    thresholds = parse_rs_thresholds(options, rollout_rs_threshold)
    with torch.no_grad():
        safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
        token_stats = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
        seq_valid = mask.any(dim=-1)
        keep = mask.clone()
        metrics: dict = {}
        for option in options:
            lower, upper = thresholds[option]
            estimator = option[-2:]
            is_k1 = estimator == "k1"
            if is_k1:  # k1 bounds are ratio bounds: compare in log space
                lower, upper = math.log(lower), math.log(upper)
            stat = token_stats[estimator]
            seq_stat = None
            if option.startswith("seq_sum"):
                seq_stat = masked_sum_unchecked(stat, mask, axis=-1)
            elif option.startswith("seq_mean"):
                seq_stat = masked_mean_unchecked(stat, mask, axis=-1)
            elif option.startswith("seq_max"):
                seq_stat = stat.masked_fill(~mask, float("-inf")).max(dim=-1).values
                seq_stat = torch.where(torch.isneginf(seq_stat), torch.zeros_like(seq_stat), seq_stat)
            per_token = stat if seq_stat is None else seq_stat.unsqueeze(-1).expand_as(stat)
            option_keep = per_token <= upper
            if is_k1:
                option_keep &= per_token >= lower
            level = "token" if seq_stat is None else "sequence"
            metrics.update(_rs_metrics(option, per_token, mask, seq_valid, level, seq_stat, upper,
                                       lower if is_k1 else 0.0, is_k1))
            rejected = ~option_keep & mask
            metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean_unchecked(rejected.to(log_ratio.dtype), mask)
            metrics[f"rollout_rs_{option}_seq_masked_fraction"] = masked_mean_unchecked(
                rejected.any(dim=-1).to(log_ratio.dtype), seq_valid)
            keep &= option_keep
        rejected = ~keep & mask
        metrics["rollout_rs_masked_fraction"] = masked_mean_unchecked(rejected.to(log_ratio.dtype), mask)
        metrics["rollout_rs_seq_masked_fraction"] = _frac(rejected.any(dim=-1))  # over all rows, as verl
    return keep, metrics


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Hard trust region: zero the mask where a divergence estimate exceeds its threshold.

    Options (comma-separated, all must pass): token_k{1,2,3} per token; seq_sum_k{1,2,3}, seq_mean_k{1,2,3},
    seq_max_k{2,3} per sequence (reject the whole row). k1 = -log_ratio with ratio bounds "L_U" (checked as
    log L <= k1 <= log U); k2 = log_ratio^2 / 2 and k3 = exp(log_ratio) - 1 - log_ratio with an upper bound.
    Returns (mask in response_mask's dtype with rejected tokens 0, metrics with unprefixed names).
    """
    mask = _check_log_ratio(log_ratio, response_mask)
    keep, metrics = _rejection_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold)
    return keep.to(response_mask.dtype), _to_floats(metrics)


# ---------------------------------------------------------------------------------------------------------------
# off-policy diagnostics and the combined entry point


def _offpolicy_metrics(old_log_prob, rollout_log_prob, mask) -> dict:
    with torch.no_grad():
        train_mean = masked_mean_unchecked(old_log_prob, mask, axis=-1)
        m: dict = {"training_ppl": torch.exp(-train_mean).mean(), "training_log_ppl": (-train_mean).mean()}
        if rollout_log_prob is None:
            return m
        log_ratio = old_log_prob - rollout_log_prob
        m["kl"] = masked_mean_unchecked(-log_ratio, mask)  # KL(pi_rollout || pi_train), direct (k1) estimator
        m["k3_kl"] = masked_mean_unchecked(torch.exp(log_ratio) - log_ratio - 1, mask)
        rollout_mean = masked_mean_unchecked(rollout_log_prob, mask, axis=-1)
        m["rollout_ppl"] = torch.exp(-rollout_mean).mean()
        m["rollout_log_ppl"] = (-rollout_mean).mean()
        log_ppl_diff = rollout_mean - train_mean
        m["log_ppl_diff"] = log_ppl_diff.mean()
        m["log_ppl_abs_diff"] = log_ppl_diff.abs().mean()
        m["log_ppl_diff_max"] = log_ppl_diff.max()
        m["log_ppl_diff_min"] = log_ppl_diff.min()
        m["ppl_ratio"] = torch.exp(log_ppl_diff).mean()
        rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
        m["chi2_token"] = masked_mean_unchecked(rho.square(), mask) - 1.0
        seq_log_ratio = torch.clamp(masked_sum_unchecked(log_ratio, mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
        m["chi2_seq"] = torch.exp(2.0 * seq_log_ratio).mean() - 1.0
    return m


def _check_log_probs(old_log_prob, rollout_log_prob, response_mask) -> torch.Tensor:
    checks.float_tensor(old_log_prob, "old_log_prob", ndim=2)
    mask = checks.mask(response_mask, "response_mask", "old_log_prob", old_log_prob)
    _require_valid_token(mask)
    checks.finite(old_log_prob, "old_log_prob", mask)
    if rollout_log_prob is not None:
        checks.float_like(rollout_log_prob, "rollout_log_prob", "old_log_prob", old_log_prob)
        checks.finite(rollout_log_prob, "rollout_log_prob", mask)
    return mask


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Mismatch diagnostics (unprefixed): training_ppl/log_ppl, and with rollout log-probs: kl
    (KL(rollout || train), k1), k3_kl, rollout_ppl/log_ppl, log_ppl_diff (+abs/max/min), ppl_ratio,
    chi2_token, chi2_seq. Per-sequence quantities are averaged over all rows, as verl."""
    mask = _check_log_probs(old_log_prob, rollout_log_prob, response_mask)
    return _to_floats(_offpolicy_metrics(old_log_prob, rollout_log_prob, mask))


def _correction_and_rejection(old_log_prob, rollout_log_prob, mask, response_mask, rollout_is, rollout_is_threshold,
                              rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold) -> tuple:
    """The combined computation on checked inputs; metrics stay tensors (prefixed)."""
    if rollout_is is not None:
        checks.choice(rollout_is, "rollout_is", IS_LEVELS)
    log_ratio = old_log_prob.detach() - rollout_log_prob
    metrics: dict = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = _rollout_correction_weights(log_ratio, mask, rollout_is, rollout_is_threshold,
                                                          bool(rollout_is_batch_normalize))
        metrics.update(is_metrics)
    new_mask = response_mask.clone()
    if rollout_rs is not None:
        keep, rs_metrics = _rejection_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold)
        new_mask = keep.to(response_mask.dtype)
        metrics.update(rs_metrics)
    metrics.update(_offpolicy_metrics(old_log_prob.detach(), rollout_log_prob, mask))
    return weights, new_mask, {METRIC_PREFIX + k: v for k, v in metrics.items()}


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights (if ``rollout_is`` and a threshold are set), rejection (if ``rollout_rs``), diagnostics.

    Returns (weights or None, response_mask with rejected tokens 0 (a copy, same dtype), metrics prefixed
    "rollout_corr/"). Weights are computed on the ORIGINAL mask, as verl does: rejected tokens keep a weight but
    the returned mask drops them from the loss.
    """
    mask = _check_log_probs(old_log_prob, rollout_log_prob, response_mask)
    if rollout_log_prob is None:
        raise ValueError("rollout_log_prob is required for rollout correction")
    weights, new_mask, metrics = _correction_and_rejection(
        old_log_prob, rollout_log_prob, mask, response_mask, rollout_is, rollout_is_threshold,
        rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)
    return weights, new_mask, _to_floats(metrics)


def bypass_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass mode's correction, per micro-batch inside the policy loss: IS weights pi_current / pi_rollout and
    the rejection mask from the CURRENT log-prob (verl's compute_policy_loss_bypass_mode calls the combined entry
    point with old_log_prob=log_prob). Same returns as ``compute_rollout_correction_and_rejection_mask`` but
    the metrics are detached 0-dim tensors (no host sync per micro-batch). A micro-batch without a valid token
    (empty responses only) gets no weights, an all-zero mask and the same metric keys with value 0: the update
    weights metrics by valid tokens, so they do not count.
    """
    checks.float_tensor(log_prob, "log_prob", ndim=2)
    mask = checks.mask(response_mask, "response_mask", "log_prob", log_prob)
    checks.float_like(rollout_log_prob, "rollout_log_prob", "log_prob", log_prob)
    checks.finite(log_prob, "log_prob", mask)
    checks.finite(rollout_log_prob, "rollout_log_prob", mask)
    args = (rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)
    if bool(mask.any()):
        return _correction_and_rejection(log_prob, rollout_log_prob, mask, response_mask, *args)
    # the metric keys of a one-token batch, all 0
    one = torch.zeros(1, 1, dtype=log_prob.dtype, device=log_prob.device)
    _, _, metrics = _correction_and_rejection(one, one, torch.ones_like(one, dtype=torch.bool), one, *args)
    return None, torch.zeros_like(response_mask), {k: torch.zeros((), dtype=log_prob.dtype) for k in metrics}
