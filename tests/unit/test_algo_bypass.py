"""Bypass mode's policy loss (algorithm.rollout_correction.bypass_mode) against verl 0.9.1's
compute_policy_loss_bypass_mode called on the same tensors: loss, gradient w.r.t. log_prob and metrics, for
loss_type ppo_clip and reinforce, with IS weights (token / sequence) and rejection on or off.

Tolerances as test_algo_rollout_correction.py (float64: values rtol 1e-7; metrics rel 1e-6, clamped *_std as
variances). The old log-prob IS the rollout's here: verl's function takes it as ``old_log_prob``.
"""
import os
import sys
from pathlib import Path

os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from megatron_ppo.algo import losses as L  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_algo_rollout_correction import assert_metrics_equal, log_probs, ragged_mask  # noqa: E402

TOL64 = dict(rtol=1e-7, atol=1e-7)
FAST = settings(max_examples=30, deadline=None)
AGG = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def verl_config(loss_type, rc: dict, counts: dict, clip=0.2, low=None, high=None, c=3.0):
    return OmegaConf.create(dict(
        clip_ratio=clip, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, global_batch_info=counts,
        policy_loss={"loss_mode": "bypass_mode", "rollout_correction": {"loss_type": loss_type, **rc}}))


def both(rollout, log_prob, adv, mask, loss_type, rc, agg="token-mean", **clip):
    """(ours, verl's): each (loss, d loss / d log_prob, metrics). Both get the mini-batch's counts before
    rejection, as the trainer passes them (verl: batch_num_tokens from the loss mask, global_batch_size)."""
    counts = dict(batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    loss, metrics = L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type=loss_type, loss_agg_mode=agg,
                                                 **counts, **rc, **clip)
    (grad,) = torch.autograd.grad(loss, log_prob)
    verl_loss, verl_metrics = core_algos.compute_policy_loss_bypass_mode(
        rollout, log_prob, adv, mask.to(log_prob.dtype), loss_agg_mode=agg, config=verl_config(loss_type, rc, counts, **{
            k.replace("clip_ratio_", "").replace("clip_ratio", "clip"): v for k, v in clip.items()}))
    (verl_grad,) = torch.autograd.grad(verl_loss, log_prob)
    return (loss, grad, metrics), (verl_loss, verl_grad, verl_metrics)


def assert_same(ours, theirs):
    (loss, grad, metrics), (verl_loss, verl_grad, verl_metrics) = ours, theirs
    torch.testing.assert_close(loss, verl_loss, **TOL64)
    torch.testing.assert_close(grad, verl_grad, **TOL64)
    assert float(metrics["actor/pg_loss"]) == pytest.approx(verl_loss.item(), rel=1e-6, abs=1e-7)
    assert_metrics_equal({k: float(v) for k, v in metrics.items() if k != "actor/pg_loss"}, verl_metrics)


def inputs(seed, batch, length, spread, empty_row=True):
    gen = torch.Generator().manual_seed(seed)
    current, rollout = log_probs(gen, batch, length, spread)  # current = rollout + spread * noise
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return rollout, current.requires_grad_(True), adv, ragged_mask(gen, batch, length, empty_row)


RC_CASES = [
    {},  # no IS, no RS: plain PPO / REINFORCE against the rollout policy
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "sequence", "rollout_is_threshold": 5.0},
    {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.5_3.0"},  # IcePop
    {"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0},
    {"rollout_rs": "seq_mean_k3,token_k2", "rollout_rs_threshold": "0.05,0.4"},
    {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.5},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.8"},
]


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 12),
       loss_type=st.sampled_from(["ppo_clip", "reinforce"]), rc=st.sampled_from(RC_CASES),
       agg=st.sampled_from(AGG), spread=st.sampled_from([0.05, 0.5, 2.0]))
def test_bypass_loss_matches_verl(seed, batch, length, loss_type, rc, agg, spread):
    rollout, log_prob, adv, mask = inputs(seed, batch, length, spread)
    try:
        ours, theirs = both(rollout, log_prob, adv, mask, loss_type, rc, agg, clip_ratio=0.2, clip_ratio_low=0.15,
                            clip_ratio_high=0.28, clip_ratio_c=3.0)
    except ZeroDivisionError:  # IcePop dropped every weight: verl's ESS divides by 0 (ours: 0, test_algo_rollout_...)
        return
    assert_same(ours, theirs)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("rc", RC_CASES[1:3] + RC_CASES[5:8], ids=lambda rc: ",".join(map(str, rc.values())))
def test_bypass_loss_matches_verl_in_float32(loss_type, rc):
    rollout, log_prob, adv, mask = inputs(3, 5, 9, 0.5)
    rollout, adv = rollout.float(), adv.float()
    log_prob = log_prob.detach().float().requires_grad_(True)
    (loss, grad, metrics), (verl_loss, verl_grad, verl_metrics) = both(rollout, log_prob, adv, mask, loss_type, rc)
    torch.testing.assert_close(loss, verl_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, verl_grad, rtol=1e-5, atol=1e-6)
    assert set(metrics) - {"actor/pg_loss"} == set(verl_metrics)


def test_ppo_clip_does_not_apply_is_weights_and_reinforce_does():
    """verl: in ppo_clip the ratio to the rollout policy IS the correction (weights would count it twice), so
    rollout_is only adds metrics; reinforce multiplies -A log_prob by the (truncated) weights."""
    rollout, log_prob, adv, mask = inputs(7, 4, 8, 0.8, empty_row=False)
    rc = {"rollout_is": "token", "rollout_is_threshold": 2.0}
    clip_is, m = L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type="ppo_clip", **rc)
    clip_plain, m_plain = L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type="ppo_clip")
    torch.testing.assert_close(clip_is, clip_plain, rtol=0, atol=0)
    assert "rollout_corr/rollout_is_mean" in m and "rollout_corr/rollout_is_mean" not in m_plain
    assert float(m["rollout_corr/rollout_is_max"]) == 2.0 and float(m["rollout_corr/rollout_is_min"]) < 0.5
    plain, _ = L.compute_policy_loss(rollout, log_prob, adv, mask)  # = PPO with old = rollout
    torch.testing.assert_close(clip_plain, plain, rtol=0, atol=0)

    reinforce, _ = L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type="reinforce", **rc)
    (grad,) = torch.autograd.grad(reinforce, log_prob)
    w = torch.exp(log_prob.detach() - rollout).clamp(max=2.0)
    expected = torch.where(mask, -adv * w / mask.sum(), torch.zeros_like(adv))  # d/d log_prob of token-mean
    torch.testing.assert_close(grad, expected, **TOL64)
    no_is, _ = L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type="reinforce")
    assert not torch.allclose(reinforce, no_is)


def test_rejected_tokens_leave_the_loss_but_not_its_normaliser():
    """Rejection (from the CURRENT log-prob) drops tokens from the policy loss; the token-mean normaliser given
    (the mini-batch's tokens before rejection, as verl's batch_num_tokens) stays."""
    rollout = torch.zeros(1, 4, dtype=torch.float64)
    log_prob = torch.tensor([[0.0, 0.1, 3.0, -0.2]], dtype=torch.float64, requires_grad=True)  # token 2: ratio e^3
    adv = torch.ones(1, 4, dtype=torch.float64)
    mask = torch.ones(1, 4)
    for loss_type in ("ppo_clip", "reinforce"):
        loss, m = L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type=loss_type,
                                               rollout_rs="token_k1", rollout_rs_threshold=2.0, batch_num_tokens=4)
        (grad,) = torch.autograd.grad(loss, log_prob)
        assert grad[0, 2] == 0 and (grad[0, [0, 1, 3]] != 0).all(), (loss_type, grad)
        assert float(m["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx(0.25)


def test_micro_batch_without_valid_tokens_gives_zero_loss_and_the_same_metric_keys():
    rollout, log_prob, adv, mask = inputs(1, 3, 5, 0.3, empty_row=False)
    rc = {"rollout_is": "sequence", "rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}
    _, full = L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type="reinforce", **rc)
    loss, empty = L.compute_policy_loss_bypass(rollout, log_prob, adv, torch.zeros_like(mask), loss_type="reinforce",
                                               batch_num_tokens=7, **rc)
    assert float(loss.detach()) == 0.0 and set(empty) == set(full)
    assert all(float(v) == 0.0 for v in empty.values())


def test_bypass_loss_bad_inputs_name_the_argument():
    rollout, log_prob, adv, mask = inputs(2, 2, 3, 0.3, empty_row=False)
    with pytest.raises(ValueError, match="loss_type"):
        L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, loss_type="vanilla")
    with pytest.raises(ValueError, match="rollout_log_prob"):
        L.compute_policy_loss_bypass(rollout[:, :2], log_prob, adv, mask)
    bad = rollout.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="rollout_log_prob has 1 NaN"):
        L.compute_policy_loss_bypass(bad, log_prob, adv, mask, loss_type="reinforce")
    with pytest.raises(ValueError, match="rollout_rs"):
        L.compute_policy_loss_bypass(rollout, log_prob, adv, mask, rollout_rs="token_k9", rollout_rs_threshold=2.0)
