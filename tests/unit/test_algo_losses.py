"""Loss aggregation, policy / value losses, entropy and KL estimators against verl 0.9.1.

Tolerances: float64 rtol 1e-7 / atol 1e-7 (verl's +1e-8 denominators), float32 rtol 1e-5 / atol 1e-6;
gradients are compared at the same tolerances.
"""
import os
import zlib

os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402

from megatron_ppo.algo import losses as L  # noqa: E402

TOL64 = dict(rtol=1e-7, atol=1e-7)
TOL32 = dict(rtol=1e-5, atol=1e-6)
FAST = settings(max_examples=40, deadline=None)
MODES = list(L.AGG_LOSS_MODES)


def ragged_mask(gen, batch, length, empty_row=False):
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask &= torch.rand(batch, length, generator=gen) > 0.2
    mask[0, 0] = True
    if empty_row and batch > 1:
        mask[-1] = False
    return mask


def tol_for(dtype):
    return TOL64 if dtype == torch.float64 else TOL32


# ------------------------------------------------------------------------------------------------- aggregation


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 16),
       mode=st.sampled_from(MODES), dp_size=st.integers(1, 4), scale=st.sampled_from([None, 7.0, 512]),
       empty_row=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_agg_loss_matches_verl(seed, batch, length, mode, dp_size, scale, empty_row, dtype):
    gen = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(batch, length, generator=gen, dtype=dtype)
    mask = ragged_mask(gen, batch, length, empty_row)
    extra = {}
    if dp_size > 1:  # a DP driver passes the global counts (here: this shard's plus other ranks')
        extra = dict(batch_num_tokens=int(mask.sum()) + int(torch.randint(0, 50, (1,), generator=gen)),
                     global_batch_size=int(mask.any(-1).sum()) + int(torch.randint(0, 8, (1,), generator=gen)))
    ours = L.agg_loss(loss_mat, mask, mode, dp_size=dp_size, loss_scale_factor=scale, **extra)
    theirs = core_algos.agg_loss(loss_mat, mask.to(dtype), mode, dp_size=dp_size, loss_scale_factor=scale, **extra)
    torch.testing.assert_close(ours, theirs, **tol_for(dtype))


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_is_invariant_to_data_parallel_split(mode):
    """Average over DP shards of each rank's loss (what DP gradient averaging does) == the full-batch loss."""
    gen = torch.Generator().manual_seed(11)
    loss_mat = torch.randn(12, 9, generator=gen, dtype=torch.float64)
    mask = ragged_mask(gen, 12, 9, empty_row=True)
    full = L.agg_loss(loss_mat, mask, mode, loss_scale_factor=9)
    dp = 3
    counts = dict(batch_num_tokens=int(mask.sum()), global_batch_size=int(mask.any(-1).sum()))
    shards = [L.agg_loss(lm, m, mode, dp_size=dp, loss_scale_factor=9, **counts)
              for lm, m in zip(loss_mat.chunk(dp), mask.chunk(dp), strict=True)]
    torch.testing.assert_close(sum(shards) / dp, full, **TOL64)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_empty_mask_is_zero_not_nan(mode):
    loss_mat = torch.randn(3, 4, requires_grad=True)
    mask = torch.zeros(3, 4)
    ours = L.agg_loss(loss_mat, mask, mode)
    assert ours.item() == 0.0
    ours.backward()
    assert (loss_mat.grad == 0).all()
    theirs = core_algos.agg_loss(loss_mat.detach(), mask, mode)
    if mode != "token-sum":  # the documented deviation: verl divides 0 by 0
        assert torch.isnan(theirs)


def test_agg_loss_needs_global_counts_with_dp():
    with pytest.raises(ValueError, match="batch_num_tokens"):
        L.agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        L.agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        L.agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "token_mean")
    with pytest.raises(ValueError, match="dp_size"):
        L.agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "token-mean", dp_size=0)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        L.agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "seq-mean-token-sum-norm", loss_scale_factor=0)


# ------------------------------------------------------------------------------------------------- policy loss


def policy_inputs(gen, batch, length, dtype, spread=1.0):
    old = -torch.rand(batch, length, generator=gen, dtype=dtype) * 3
    log_prob = (old + spread * torch.randn(batch, length, generator=gen, dtype=dtype)).requires_grad_(True)
    adv = torch.randn(batch, length, generator=gen, dtype=dtype)
    return old, log_prob, adv


def verl_policy_config(clip_ratio, low, high, c, **batch_info):
    return OmegaConf.create(dict(clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                                 global_batch_info=batch_info))


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), length=st.integers(1, 12),
       mode=st.sampled_from(MODES), clip=st.floats(0.05, 0.5), low=st.one_of(st.none(), st.floats(0.0, 0.9)),
       high=st.one_of(st.none(), st.floats(0.0, 2.0)), c=st.floats(1.01, 10.0), weighted=st.booleans(),
       spread=st.sampled_from([0.05, 1.0, 30.0]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_policy_loss_matches_verl(seed, batch, length, mode, clip, low, high, c, weighted, spread, dtype):
    gen = torch.Generator().manual_seed(seed)
    old, log_prob, adv = policy_inputs(gen, batch, length, dtype, spread)
    mask = ragged_mask(gen, batch, length, empty_row=True)
    weights = torch.rand(batch, length, generator=gen, dtype=dtype) * 2 if weighted else None

    loss, metrics = L.compute_policy_loss(old, log_prob, adv, mask, clip_ratio=clip, clip_ratio_low=low,
                                          clip_ratio_high=high, clip_ratio_c=c, loss_agg_mode=mode,
                                          rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, log_prob)
    verl_loss, verl_metrics = core_algos.compute_policy_loss_vanilla(
        old, log_prob, adv, mask.to(dtype), loss_agg_mode=mode, config=verl_policy_config(clip, low, high, c),
        rollout_is_weights=weights)
    (verl_grad,) = torch.autograd.grad(verl_loss, log_prob)
    tol = tol_for(dtype)
    torch.testing.assert_close(loss, verl_loss, **tol)
    torch.testing.assert_close(grad, verl_grad, **tol)
    for key, value in verl_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert float(metrics["actor/pg_loss"]) == pytest.approx(verl_loss.item(), rel=1e-5, abs=1e-6)


@pytest.mark.filterwarnings("ignore:.*deprecated:FutureWarning")
def test_policy_loss_exercises_both_clips_and_matches_deprecated_verl_api():
    gen = torch.Generator().manual_seed(5)
    old, log_prob, adv = policy_inputs(gen, 8, 32, torch.float64, spread=2.0)
    mask = ragged_mask(gen, 8, 32)
    loss, metrics = L.compute_policy_loss(old, log_prob, adv, mask, clip_ratio=0.2, clip_ratio_high=0.28,
                                          clip_ratio_c=3.0)
    # the inputs really hit both the PPO clip and the dual clip, so the parity below means something
    assert float(metrics["actor/pg_clipfrac"]) > 0.1 and float(metrics["actor/pg_clipfrac_lower"]) > 0.01
    verl = core_algos.compute_policy_loss(old, log_prob, adv, mask.double(), cliprange=0.2, cliprange_low=0.2,
                                          cliprange_high=0.28, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, verl[0], **TOL64)
    for key, value in zip(("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"), verl[1:], strict=True):
        torch.testing.assert_close(metrics[key], value, **TOL64)


def test_policy_loss_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2, dtype=torch.float64)
    log_prob = torch.log(torch.tensor([[10.0, 10.0]], dtype=torch.float64))  # ratio 10
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    loss, _ = L.compute_policy_loss(old, log_prob, adv, torch.ones(1, 2), clip_ratio=0.2, clip_ratio_c=3.0,
                                    loss_agg_mode="token-sum")
    # A<0: min(3, max(10, 1.2)) = 3 ; A>0: max(-10, -1.2) = -1.2
    assert loss.item() == pytest.approx(3.0 - 1.2)


@pytest.mark.parametrize("kwargs,name", [
    (dict(clip_ratio_c=1.0), "clip_ratio_c"), (dict(clip_ratio_low=1.5), "clip_ratio_low"),
    (dict(clip_ratio_high=-0.1), "clip_ratio_high"), (dict(loss_agg_mode="mean"), "loss_agg_mode"),
])
def test_policy_loss_rejects_bad_config(kwargs, name):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=name):
        L.compute_policy_loss(x, x, x, torch.ones(2, 3), **kwargs)


def test_policy_loss_rejects_bad_weights():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        L.compute_policy_loss(x, x, x, torch.ones(2, 3), rollout_is_weights=-torch.ones(2, 3))
    with pytest.raises(ValueError, match="rollout_is_weights"):
        L.compute_policy_loss(x, x, x, torch.ones(2, 3), rollout_is_weights=torch.ones(2, 2))


# -------------------------------------------------------------------------------------------------- value loss


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), length=st.integers(1, 12),
       mode=st.sampled_from(MODES), clip=st.floats(0.01, 2.0), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_value_loss_matches_verl(seed, batch, length, mode, clip, dtype):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=gen, dtype=dtype)
    returns = torch.randn(batch, length, generator=gen, dtype=dtype)
    vpreds = (values + torch.randn(batch, length, generator=gen, dtype=dtype)).requires_grad_(True)
    mask = ragged_mask(gen, batch, length, empty_row=True)
    loss, clipfrac = L.compute_value_loss(vpreds, returns, values, mask, clip, loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, vpreds)
    verl_loss, verl_clipfrac = core_algos.compute_value_loss(vpreds, returns, values, mask.to(dtype), clip,
                                                             loss_agg_mode=mode)
    (verl_grad,) = torch.autograd.grad(verl_loss, vpreds)
    tol = tol_for(dtype)
    torch.testing.assert_close(loss, verl_loss, **tol)
    torch.testing.assert_close(grad, verl_grad, **tol)
    torch.testing.assert_close(clipfrac, verl_clipfrac, **tol)


def test_value_loss_global_counts_match_verl():
    gen = torch.Generator().manual_seed(2)
    v, r, p = (torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = ragged_mask(gen, 4, 6)
    kw = dict(dp_size=2, batch_num_tokens=40, global_batch_size=9, loss_scale_factor=16)
    for mode in MODES:
        ours, _ = L.compute_value_loss(p, r, v, mask, 0.5, mode, **kw)
        theirs, _ = core_algos.compute_value_loss(p, r, v, mask.double(), 0.5, mode, **kw)
        torch.testing.assert_close(ours, theirs, **TOL64)


def test_explained_variance_matches_verl_formula():
    gen = torch.Generator().manual_seed(4)
    returns = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    values = returns + 0.3 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = ragged_mask(gen, 5, 7)
    fmask = mask.double()
    # verl metric_utils: 1 - var(valid returns - valid values) / (var(valid returns) + 1e-5), unbiased
    expected = 1.0 - verl_F.masked_var(returns - values, fmask) / (verl_F.masked_var(returns, fmask) + 1e-5)
    torch.testing.assert_close(L.explained_variance(values, returns, mask), expected, **TOL64)
    one = torch.zeros(5, 7)
    one[0, 0] = 1
    assert L.explained_variance(values, returns, one).item() == 0.0  # documented: < 2 valid tokens -> 0


# ----------------------------------------------------------------------------------------------------- entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_matches_verl(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 97, generator=gen, dtype=dtype) * 4).requires_grad_(True)
    ours = L.entropy_from_logits(logits)
    theirs = verl_F.entropy_from_logits(logits)
    torch.testing.assert_close(ours, theirs, **tol_for(dtype))
    g = torch.randn(3, 5, generator=gen, dtype=dtype)
    torch.testing.assert_close(torch.autograd.grad(ours, logits, g)[0], torch.autograd.grad(theirs, logits, g)[0],
                               **tol_for(dtype))


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_chunked_entropy_matches_verl_and_plain_autograd(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(50, 131, generator=gen) * 3).requires_grad_(True)
    chunked = L.entropy_from_logits_with_chunking(logits, chunk_size)
    torch.testing.assert_close(chunked, verl_F.entropy_from_logits_with_chunking(logits.detach(), chunk_size),
                               **TOL32)
    # gradient: closed-form chunked backward vs autograd through the plain formula, in float64
    logits64 = logits.detach().double().requires_grad_(True)
    g = torch.randn(50, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(L.entropy_from_logits_with_chunking(logits64, chunk_size), logits64, g)[0]
    ref = torch.autograd.grad(verl_F.entropy_from_logits(logits64), logits64, g)[0]
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    # leading dims are kept; float32 grads come back in the logits' dtype
    grad32 = torch.autograd.grad(chunked.sum(), logits)[0]
    assert grad32.dtype == torch.float32 and chunked.shape == (50,)
    assert L.entropy_from_logits_with_chunking(logits.detach().reshape(5, 10, 131), chunk_size).shape == (5, 10)


def test_chunked_entropy_bf16_upcasts_like_verl():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(9, 33, generator=gen) * 2).to(torch.bfloat16)
    ours = L.entropy_from_logits_with_chunking(logits, 4)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, verl_F.entropy_from_logits_with_chunking(logits, 4), **TOL32)


def test_chunked_entropy_keeps_no_full_size_buffers_for_backward():
    """Bounded memory: autograd saves only the logits themselves, not [N, V] softmax/products (plain path)."""
    logits = torch.randn(64, 200, requires_grad=True)

    def saved_numel(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            out = fn(logits)
        return out, sum(sizes)

    _, chunked = saved_numel(lambda x: L.entropy_from_logits_with_chunking(x, 8))
    _, plain = saved_numel(L.entropy_from_logits)
    _, verl_chunked = saved_numel(lambda x: verl_F.entropy_from_logits_with_chunking(x, 8))
    assert chunked == logits.numel()
    assert plain >= 3 * logits.numel() and verl_chunked >= 3 * logits.numel()  # verl bounds the forward only


def test_entropy_rejects_nan_logits():
    logits = torch.randn(2, 3, 5)
    logits[1, 2, 0] = float("nan")
    for fn in (L.entropy_from_logits, L.entropy_from_logits_with_chunking):
        with pytest.raises(ValueError, match="logits"):
            fn(logits)
    with pytest.raises(ValueError, match="chunk_size"):
        L.entropy_from_logits_with_chunking(torch.randn(2, 3), 0)


# ---------------------------------------------------------------------------------------------- KL estimators

KL_TYPES = [t + plus for t in L.KL_PENALTY_TYPES for plus in ("", "+")]


@pytest.mark.parametrize("kind", KL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_penalty_matches_verl_values_and_gradients(kind, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()) % 1000)  # hash(str) changes per process
    ref = -torch.rand(6, 10, generator=gen, dtype=dtype) * 5
    logprob = ref + 2 * torch.randn(6, 10, generator=gen, dtype=dtype)
    logprob[0, :3] = ref[0, :3] + torch.tensor([25.0, -25.0, -12.0], dtype=dtype)  # hit the +-20 and 10 clamps
    logprob.requires_grad_(True)
    ours = L.kl_penalty(logprob, ref, kind)
    theirs = core_algos.kl_penalty(logprob, ref, kind)
    torch.testing.assert_close(ours, theirs, **tol_for(dtype))
    g = torch.randn(6, 10, generator=gen, dtype=dtype)
    torch.testing.assert_close(torch.autograd.grad(ours, logprob, g)[0], torch.autograd.grad(theirs, logprob, g)[0],
                               **tol_for(dtype))


def test_straight_through_is_k3_forward_with_k2_gradient():
    ref = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    logprob = torch.tensor([[-1.3, -1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    value = L.kl_penalty(logprob, ref, "k3+")
    torch.testing.assert_close(value, L.kl_penalty(logprob, ref, "k3"))
    (grad,) = torch.autograd.grad(value.sum(), logprob)
    torch.testing.assert_close(grad, (logprob - ref).detach())  # d/dx 0.5 (x - ref)^2


@pytest.mark.parametrize("kind", ["full", "k4", "", "+", None])
def test_kl_penalty_rejects_unknown_type(kind):
    with pytest.raises(ValueError, match="kl_penalty"):
        L.kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), kind)


def test_kl_penalty_checks_only_valid_positions_when_given_a_mask():
    logprob, ref = torch.zeros(1, 3), torch.zeros(1, 3)
    logprob[0, 2] = float("-inf")
    with pytest.raises(ValueError, match="logprob"):
        L.kl_penalty(logprob, ref, "k1")
    out = L.kl_penalty(logprob, ref, "k1", response_mask=torch.tensor([[1, 1, 0]]))
    assert out[0, :2].tolist() == [0.0, 0.0]
