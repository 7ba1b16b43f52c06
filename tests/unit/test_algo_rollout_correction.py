"""Rollout correction (IS weights, rejection masks, off-policy metrics) against verl 0.9.1 rollout_corr_helper.

Weights and masks: float64 at rtol 1e-7 / atol 1e-7. Metric dicts: same keys, values at rel 1e-6 / abs 1e-7
(verl's masked_mean adds 1e-8 to counts; some verl metrics are float32 fractions). The clamped-std metrics
(``*_std`` from E[x^2] - E[x]^2) are compared as variances at rel 1e-5 / abs 3e-7: verl's +1e-8 biases that
variance by about mean^2 * 1e-8 / n, which the square root blows up when the true spread is ~0.
"""
import os

os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as verl_rc  # noqa: E402

from megatron_ppo.algo import rollout_correction as R  # noqa: E402

TOL64 = dict(rtol=1e-7, atol=1e-7)
FAST = settings(max_examples=30, deadline=None)


def ragged_mask(gen, batch, length, empty_row=True):
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask &= torch.rand(batch, length, generator=gen) > 0.15
    mask[0, 0] = True
    if empty_row and batch > 2:
        mask[-1] = False
    return mask


def log_probs(gen, batch, length, spread):
    rollout = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    old = rollout + spread * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return old, rollout


def assert_metrics_equal(ours: dict, theirs: dict):
    assert set(ours) == set(theirs), (set(ours) ^ set(theirs))
    for key, value in theirs.items():
        if key.endswith("_std") and not key.endswith("_seq_std"):
            assert ours[key] ** 2 == pytest.approx(float(value) ** 2, rel=1e-5, abs=3e-7), key
        else:
            assert ours[key] == pytest.approx(float(value), rel=1e-6, abs=1e-7), key


# ----------------------------------------------------------------------------------------------------- IS weights


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 14),
       level=st.sampled_from(["token", "sequence"]), threshold=st.sampled_from([2.0, 1.2, 5, "2.0", "0.5_2.0"]),
       normalize=st.booleans(), spread=st.sampled_from([0.05, 0.5, 3.0]))
def test_is_weights_match_verl(seed, batch, length, level, threshold, normalize, spread):
    gen = torch.Generator().manual_seed(seed)
    old, rollout = log_probs(gen, batch, length, spread)
    mask = ragged_mask(gen, batch, length)
    log_ratio = old - rollout
    weights, metrics = R.compute_rollout_correction_weights(log_ratio, mask, level, threshold, normalize)
    try:
        verl_weights, verl_metrics = verl_rc.compute_rollout_correction_weights(log_ratio, mask.double(), level,
                                                                                threshold, normalize)
    except ZeroDivisionError:  # IcePop dropped every weight: verl's ESS divides by 0, ours is documented as 0
        assert (weights == 0).all() and metrics["rollout_is_eff_sample_size"] == 0.0
        return
    torch.testing.assert_close(weights, verl_weights, **TOL64)
    assert_metrics_equal(metrics, verl_metrics)
    assert not weights.requires_grad and (weights[~mask] == 0).all()


def test_is_weights_truncate_and_normalise():
    log_ratio = torch.log(torch.tensor([[0.5, 4.0, 1.0], [1.5, 1.0, 9.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights, metrics = R.compute_rollout_correction_weights(log_ratio, mask, "token", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 2.0, 1.0], [1.5, 1.0, 0.0]], dtype=torch.float64))
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["rollout_is_max"] == pytest.approx(2.0)
    kept = torch.tensor([0.5, 2.0, 1.0, 1.5, 1.0], dtype=torch.float64)  # exact population std, no epsilon
    assert metrics["rollout_is_std"] == pytest.approx(kept.std(unbiased=False).item(), rel=1e-12)
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx((kept.sum() ** 2 / (5 * kept.square().sum())).item(),
                                                                  rel=1e-7)
    normed, metrics = R.compute_rollout_correction_weights(log_ratio, mask, "token", 2.0, True)
    assert normed[mask.bool()].mean().item() == pytest.approx(1.0)
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(6.0 / 5)
    seq, _ = R.compute_rollout_correction_weights(log_ratio, mask, "sequence", 3.0)
    # row 0: 0.5 * 4 * 1 = 2; row 1: 1.5 * 1 = 1.5 (the masked 9 does not count)
    torch.testing.assert_close(seq, torch.tensor([[2.0, 2.0, 2.0], [1.5, 1.5, 0.0]], dtype=torch.float64))


def test_ess_is_zero_when_every_weight_is_dropped():
    """Deviation: IcePop bounds that drop every token -> ESS 0; verl divides by zero (ZeroDivisionError)."""
    log_ratio = torch.full((2, 3), 3.0, dtype=torch.float64)
    mask = torch.ones(2, 3)
    weights, metrics = R.compute_rollout_correction_weights(log_ratio, mask, "token", "0.5_2.0")
    assert (weights == 0).all() and metrics["rollout_is_eff_sample_size"] == 0.0
    with pytest.raises(ZeroDivisionError):
        verl_rc.compute_rollout_correction_weights(log_ratio, mask, "token", "0.5_2.0")


# ------------------------------------------------------------------------------------------------------ rejection


RS_CASES = [(opt, thr) for opt in R.RS_OPTIONS for thr in (["2.0", "0.7_1.5"] if opt.endswith("k1") else [0.05, 1.0])]
RS_CASES += [("token_k1,seq_mean_k3", "0.5_2.0,0.1"), ("seq_max_k2,token_k3,seq_sum_k1", "0.5,0.2,3.0"),
             ("token_k2, token_k2", 0.3)]


@pytest.mark.parametrize("option,threshold", RS_CASES)
def test_rejection_mask_matches_verl(option, threshold):
    gen = torch.Generator().manual_seed(len(option) * 31 + len(str(threshold)))
    old, rollout = log_probs(gen, 7, 12, 0.6)
    mask = ragged_mask(gen, 7, 12)
    for m in (mask.double(), mask):
        ours, metrics = R.compute_rollout_rejection_mask(old - rollout, m, option, threshold)
        theirs, verl_metrics = verl_rc.compute_rollout_rejection_mask(old - rollout, m.double(), option, threshold)
        assert ours.dtype == m.dtype
        torch.testing.assert_close(ours.double(), theirs, **TOL64)
        assert_metrics_equal(metrics, verl_metrics)


def test_rejection_thresholds_really_reject():
    log_ratio = torch.tensor([[0.0, 0.1, 2.0], [0.0, -0.05, 0.02]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    kept, metrics = R.compute_rollout_rejection_mask(log_ratio, mask, "token_k1", "2.0")  # |log ratio| <= log 2
    assert kept.tolist() == [[True, True, False], [True, True, True]]
    kept, metrics = R.compute_rollout_rejection_mask(log_ratio, mask, "seq_max_k2", 0.5)
    assert kept.tolist() == [[False, False, False], [True, True, True]]
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("option,threshold,match", [
    ("token_k4", 1.0, "rollout_rs"), ("", 1.0, "rollout_rs"), (None, 1.0, "rollout_rs"),
    ("token_k2", None, "rollout_rs_threshold"), ("token_k2", "0.5_2.0", r"rollout_rs_threshold\[token_k2\]"),
    ("token_k1", "2.0_0.5", r"rollout_rs_threshold\[token_k1\]"), ("token_k2", -1, "rollout_rs_threshold"),
    ("token_k2,seq_sum_k3", "1,2,3", "rollout_rs_threshold"), ("token_k2", "abc", "rollout_rs_threshold"),
])
def test_rejection_bad_options(option, threshold, match):
    with pytest.raises(ValueError, match=match):
        R.compute_rollout_rejection_mask(torch.zeros(2, 3), torch.ones(2, 3), option, threshold)


@pytest.mark.parametrize("threshold,match", [(-1.0, "upper"), ("3.0_2.0", "lower"), ("x", "parse"), (True, "number")])
def test_is_threshold_errors(threshold, match):
    with pytest.raises(ValueError, match=match):
        R.compute_rollout_correction_weights(torch.zeros(2, 3), torch.ones(2, 3), "token", threshold)


# ------------------------------------------------------------------------------------------ off-policy / combined


def test_offpolicy_metrics_match_verl():
    gen = torch.Generator().manual_seed(9)
    old, rollout = log_probs(gen, 6, 10, 0.4)
    mask = ragged_mask(gen, 6, 10)
    assert_metrics_equal(R.compute_offpolicy_metrics(old, rollout, mask),
                         verl_rc.compute_offpolicy_metrics(old, rollout, mask.double()))
    assert_metrics_equal(R.compute_offpolicy_metrics(old, None, mask),
                         verl_rc.compute_offpolicy_metrics(old, None, mask.double()))


@pytest.mark.parametrize("rollout_is,threshold,normalize,rs,rs_threshold", [
    ("token", 2.0, False, None, None),
    ("sequence", "0.5_5.0", True, "seq_mean_k3", 0.05),
    (None, 2.0, False, "token_k1,seq_max_k3", "0.6_1.6,0.5"),
    ("token", None, False, "token_k3", 0.1),
    (None, None, False, None, None),
])
def test_combined_entry_point_matches_verl(rollout_is, threshold, normalize, rs, rs_threshold):
    gen = torch.Generator().manual_seed(13)
    old, rollout = log_probs(gen, 8, 11, 0.5)
    mask = ragged_mask(gen, 8, 11)
    fmask = mask.double()
    weights, new_mask, metrics = R.compute_rollout_correction_and_rejection_mask(
        old, rollout, fmask, rollout_is, threshold, normalize, rs, rs_threshold)
    verl_weights, verl_mask, verl_metrics = verl_rc.compute_rollout_correction_and_rejection_mask(
        old, rollout, fmask, rollout_is, threshold, normalize, rs, rs_threshold)
    if verl_weights is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights, verl_weights.batch["rollout_is_weights"], **TOL64)
    torch.testing.assert_close(new_mask, verl_mask, **TOL64)
    assert new_mask.data_ptr() != fmask.data_ptr()  # a copy: the caller's mask is untouched
    assert_metrics_equal(metrics, verl_metrics)
    assert all(k.startswith("rollout_corr/") for k in metrics)


def test_rollout_correction_bad_inputs():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="response_mask"):
        R.compute_rollout_correction_and_rejection_mask(x, x, torch.zeros(2, 3), "token")
    with pytest.raises(ValueError, match="rollout_log_prob"):
        R.compute_rollout_correction_and_rejection_mask(x, torch.zeros(2, 4), torch.ones(2, 3), "token")
    with pytest.raises(ValueError, match="rollout_is"):
        R.compute_rollout_correction_and_rejection_mask(x, x, torch.ones(2, 3), "tokens")
    bad = x.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="old_log_prob"):
        R.compute_rollout_correction_and_rejection_mask(bad, x, torch.ones(2, 3), "token")
    # NaN at a masked position is ignored
    mask = torch.ones(2, 3)
    mask[1, 1] = 0
    weights, _, _ = R.compute_rollout_correction_and_rejection_mask(bad, x, mask, "token")
    assert torch.isfinite(weights).all()
