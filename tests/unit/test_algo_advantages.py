"""GAE, masked statistics and GRPO against verl 0.9.1 and float64 hand references.

Tolerances: float64 inputs are compared at rtol 1e-7 / atol 1e-7 (verl divides by count + 1e-8 where we divide
by the exact count: a relative difference of about 1e-8 / count); float32 at rtol 1e-5 / atol 1e-5. Whitening
amplifies verl's 1e-8 by 1/std, so masked_whiten is compared with a bound derived from it
(``verl_whiten_tolerance``).
"""
import os

os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402

from megatron_ppo.algo import advantages as A  # noqa: E402

TOL64 = dict(rtol=1e-7, atol=1e-7)
TOL32 = dict(rtol=1e-5, atol=1e-5)
FAST = settings(max_examples=40, deadline=None)


def ragged_mask(gen, batch, length, holes=True, empty_row=False):
    """Right-padded responses of random length, optionally with interior holes (tool/observation tokens)."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if holes:
        mask &= torch.rand(batch, length, generator=gen) > 0.25
        mask[:, 0] = True
    if empty_row and batch > 1:
        mask[int(torch.randint(0, batch, (1,), generator=gen))] = False
    return mask


def gae_reference(rewards, values, mask, gamma, lam):
    """Plain float64 reverse loop, one row at a time; masked steps are skipped (carry), outputs 0 there."""
    batch, length = len(rewards), len(rewards[0])
    adv = [[0.0] * length for _ in range(batch)]
    ret = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        next_value, gae = 0.0, 0.0
        for t in range(length - 1, -1, -1):
            if not mask[b][t]:
                continue
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            gae = delta + gamma * lam * gae
            next_value = values[b][t]
            adv[b][t] = gae
            ret[b][t] = gae + values[b][t]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------------------ GAE


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 24),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0), holes=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_gae_matches_verl(seed, batch, length, gamma, lam, holes, dtype):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=dtype)
    values = torch.randn(batch, length, generator=gen, dtype=dtype)
    mask = ragged_mask(gen, batch, length, holes)
    fmask = mask.to(dtype)
    tol = TOL64 if dtype == torch.float64 else TOL32

    adv, ret = A.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    if mask.sum() < 2:  # verl whitens inside and raises below 2 valid tokens; ours still answers (hand ref. below)
        with pytest.raises(ValueError):
            core_algos.compute_gae_advantage_return(rewards, values, fmask, gamma, lam)
        return
    verl_adv, verl_ret = core_algos.compute_gae_advantage_return(rewards, values, fmask, gamma, lam)

    # returns agree at valid positions; verl's advantages are whitened inside, ours are raw: whiten ours
    torch.testing.assert_close(ret[mask], verl_ret[mask], **tol)
    torch.testing.assert_close(verl_F.masked_whiten(adv, fmask)[mask], verl_adv[mask], **tol)
    torch.testing.assert_close(ret[mask], (adv + values)[mask], **tol)
    # deviation: 0 at masked positions (verl carries lastgaelam there)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_verl_leaves_carried_values_at_masked_positions():
    """The documented deviation, on a case where it matters: a hole inside the response."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    _, verl_ret = core_algos.compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    adv, ret = A.compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    # verl: the hole gets the carried advantage (return - value != 0); ours is exactly 0 there
    assert verl_ret[0, 1] - values[0, 1] != 0
    assert adv[0, 1] == 0 and ret[0, 1] == 0
    # and the valid tokens see through the hole: A_0 = r_3 + ... - v_0 with gamma = lam = 1
    torch.testing.assert_close(adv[0, 0], torch.tensor(1.0 - 0.1, dtype=torch.float64))


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), length=st.integers(1, 16),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
def test_gae_float64_hand_reference(seed, batch, length, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = ragged_mask(gen, batch, length, holes=True, empty_row=True)
    adv, ret = A.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


def test_gae_ignores_inputs_at_masked_positions_and_mask_dtypes_agree():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    mask = ragged_mask(gen, 4, 9, holes=True, empty_row=True)
    clean = A.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    dirty_r, dirty_v = rewards.clone(), values.clone()
    dirty_r[~mask], dirty_v[~mask] = float("nan"), float("inf")
    for m in (mask, mask.float(), mask.long(), mask.to(torch.bfloat16)):
        got = A.compute_gae_advantage_return(dirty_r, dirty_v, m, 0.99, 0.95)
        torch.testing.assert_close(got, clean, rtol=0, atol=0)


def test_gae_empty_length_and_no_grad():
    adv, ret = A.compute_gae_advantage_return(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0), 1.0, 1.0)
    assert adv.shape == ret.shape == (3, 0)
    values = torch.randn(2, 4, requires_grad=True)
    adv, ret = A.compute_gae_advantage_return(torch.randn(2, 4), values, torch.ones(2, 4), 1.0, 0.9)
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize("gamma,lam,name", [(1.5, 0.9, "gamma"), (0.9, -0.1, "lam"), (float("nan"), 1.0, "gamma")])
def test_gae_rejects_bad_coefficients(gamma, lam, name):
    with pytest.raises(ValueError, match=name):
        A.compute_gae_advantage_return(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma, lam)


# ------------------------------------------------------------------------------------------------ masked stats


VERL_COUNT_EPS = 1e-8  # verl's masked_mean divides by mask.sum() + 1e-8


def verl_whiten_tolerance(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool) -> torch.Tensor:
    """Per-element bound on |ours - verl| for masked_whiten in float64: verl's count epsilon, then rounding.

    With n valid values, exact mean m, unbiased variance v and scale s = 1/sqrt(v + 1e-8) (ours: exact count):
    - verl's mean m' = S / (n + eps) = m n / (n + eps), so |m - m'| = |m| eps / (n + eps) <= |m| eps / n;
    - verl's variance is centred on m' and divided by n + eps: v' = v n / (n + eps) + O(eps^2), a relative change
      <= eps / n, so s' = s (1 + d) with |d| <= (1/2) (v / (v + 1e-8)) eps / n <= eps / (2n);
    - w = (x - m) s and w' = (x - m') s' give w' - w = (m - m') s' + (x - m)(s' - s), i.e.
      |w' - w| <= |m| s eps / n + |w| eps / (2n) to first order; shift_mean=False adds m' instead of m: + |m| eps / n.
    The bound is doubled to cover second-order terms. Rounding: the float64 sums carry <= n ulps of max|x| into the
    mean and variance, which whitening also scales by s: 64 n 2^-53 (1 + max|x|)(1 + s) (plus 1e-12 absolute).
    (The failing CI example -- n = 2, m ~ 5, s = 8.2 -- differs by 2.07e-7 = |m| s eps / n, over the old 1e-7.)
    """
    valid = mask.bool()
    n = float(valid.sum())
    x = values.double()
    m = x[valid].mean()
    var = x[valid].var(unbiased=True) if n >= 2 else torch.zeros((), dtype=torch.float64)
    scale = torch.rsqrt(var + A.WHITEN_EPS)
    w = (x - m) * scale
    eps_term = m.abs() * scale + w.abs() / 2 + (0 if shift_mean else m.abs())
    eps_bound = 2 * VERL_COUNT_EPS / n * eps_term
    max_abs = x[valid].abs().max()
    rounding = 64 * n * 2.0**-53 * (1 + max_abs) * (1 + scale) + 1e-12
    return eps_bound + rounding


def assert_whiten_matches_verl(values, mask, shift_mean, dtype):
    ours = A.masked_whiten(values, mask, shift_mean)
    verl = verl_F.masked_whiten(values, mask.to(dtype), shift_mean)
    if dtype == torch.float32:  # n + 1e-8 rounds to n in float32: verl and we run the same float32 operations
        torch.testing.assert_close(ours, verl, **TOL32)
        return
    bound = verl_whiten_tolerance(values, mask, shift_mean)
    excess = (ours - verl).abs() - bound
    assert (excess <= 0).all(), (
        f"masked_whiten differs from verl by {(ours - verl).abs().max().item():.3g}, beyond the derived bound "
        f"{bound.flatten()[int(excess.argmax())].item():.3g}")


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(2, 20),
       shift_mean=st.booleans(), unbiased=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]))
@example(seed=39327, batch=1, length=2, shift_mean=True, unbiased=False, dtype=torch.float64)  # the CI failure
def test_masked_statistics_match_verl(seed, batch, length, shift_mean, unbiased, dtype):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=gen, dtype=dtype) * 3 + 1
    mask = ragged_mask(gen, batch, length, holes=True, empty_row=True)
    mask[0, :2] = True  # at least 2 valid values: verl raises below that
    fmask = mask.to(dtype)
    tol = TOL64 if dtype == torch.float64 else TOL32
    torch.testing.assert_close(A.masked_mean(values, mask), verl_F.masked_mean(values, fmask), **tol)
    torch.testing.assert_close(A.masked_mean(values, mask, axis=-1), verl_F.masked_mean(values, fmask, axis=-1), **tol)
    torch.testing.assert_close(A.masked_sum(values, mask, axis=-1), verl_F.masked_sum(values, fmask, axis=-1), **tol)
    torch.testing.assert_close(A.masked_var(values, mask, unbiased), verl_F.masked_var(values, fmask, unbiased), **tol)
    assert_whiten_matches_verl(values, mask, shift_mean, dtype)


def test_whiten_ci_failure_is_verls_epsilon_and_within_the_derived_bound():
    """The hypothesis example that failed CI at 1e-7: the difference is verl's count epsilon times 1/std."""
    gen = torch.Generator().manual_seed(39327)
    values = torch.randn(1, 2, generator=gen, dtype=torch.float64) * 3 + 1
    mask = ragged_mask(gen, 1, 2, holes=True, empty_row=True)
    mask[0, :2] = True
    ours, verl = A.masked_whiten(values, mask), verl_F.masked_whiten(values, mask.double())
    diff = (ours - verl).abs().max().item()
    assert diff > TOL64["atol"] + TOL64["rtol"] * verl.abs().max().item()  # the old tolerance rejects it
    mean, scale = values.mean(), torch.rsqrt(values.var() + A.WHITEN_EPS)
    predicted = (mean.abs() * scale * VERL_COUNT_EPS / 2).item()  # |m| s eps / n, n = 2
    assert abs(diff - predicted) < 0.05 * predicted
    assert_whiten_matches_verl(values, mask, True, torch.float64)


def test_statistics_with_fewer_than_two_valid_values_are_defined():
    values = torch.tensor([[3.0, 5.0, -2.0]])
    none, one = torch.zeros(1, 3), torch.tensor([[0.0, 1.0, 0.0]])
    # verl: mean 0 for an empty mask, ValueError for the unbiased variance (and hence whitening)
    with pytest.raises(ValueError):
        verl_F.masked_var(values, none)
    with pytest.raises(ValueError):
        verl_F.masked_whiten(values, one)
    assert A.masked_mean(values, none) == 0 and A.masked_var(values, none) == 0
    assert A.masked_var(values, one) == 0 and A.masked_var(values, one, unbiased=False) == 0
    torch.testing.assert_close(A.masked_whiten(values, none), values)  # mean 0, scale 1: unchanged
    torch.testing.assert_close(A.masked_whiten(values, one), values - 5.0)  # centred only
    torch.testing.assert_close(A.masked_whiten(values, one, shift_mean=False), values)
    assert A.masked_mean(values, none, axis=-1).tolist() == [0.0]


# ------------------------------------------------------------------------------------------------------- GRPO


def outcome_batch(gen, n_groups, max_group, length, dtype):
    sizes = torch.randint(1, max_group + 1, (n_groups,), generator=gen).tolist()
    index = np.array([f"uid-{g}" for g, size in enumerate(sizes) for _ in range(size)], dtype=object)
    perm = torch.randperm(len(index), generator=gen).numpy()
    index = index[perm]
    batch = len(index)
    mask = ragged_mask(gen, batch, length, holes=False)
    rewards = torch.zeros(batch, length, dtype=dtype)
    last = mask.sum(-1) - 1
    rewards[torch.arange(batch), last] = torch.randint(0, 2, (batch,), generator=gen).to(dtype) + 0.1 * torch.randn(
        batch, generator=gen, dtype=dtype)
    return rewards, mask, index


@FAST
@given(seed=st.integers(0, 2**31 - 1), n_groups=st.integers(1, 6), max_group=st.integers(1, 5),
       length=st.integers(1, 10), norm=st.booleans(), epsilon=st.sampled_from([1e-6, 1e-3, 0.0]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_grpo_matches_verl(seed, n_groups, max_group, length, norm, epsilon, dtype):
    gen = torch.Generator().manual_seed(seed)
    rewards, mask, index = outcome_batch(gen, n_groups, max_group, length, dtype)
    if epsilon == 0.0 and norm:  # verl: 0/0 = NaN for a group of equal scores; ours refuses epsilon 0 here
        with pytest.raises(ValueError, match="epsilon"):
            A.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=0.0)
        return
    adv, ret = A.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm)
    verl_adv, verl_ret = core_algos.compute_grpo_outcome_advantage(
        rewards.clone(), mask.to(dtype), index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm)
    tol = TOL64 if dtype == torch.float64 else TOL32
    torch.testing.assert_close(adv, verl_adv, **tol)
    torch.testing.assert_close(ret, verl_ret, **tol)


def test_grpo_singleton_groups_and_index_forms():
    rewards = torch.tensor([[0.0, 2.0], [1.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    adv, _ = A.compute_grpo_outcome_advantage(rewards, mask, ["a", "b", "b"], epsilon=0.5)
    # singleton group "a": mean 0, std 1 (verl) -> 2 / (1 + 0.5) on every valid token
    torch.testing.assert_close(adv[0], torch.tensor([2.0 / 1.5, 2.0 / 1.5]))
    std_b = torch.tensor([1.0, 3.0]).std()
    torch.testing.assert_close(adv[1:, 0], (torch.tensor([1.0, 3.0]) - 2.0) / (std_b + 0.5))
    assert (adv[1:, 1] == 0).all()
    for index in (np.array([7, 9, 9]), torch.tensor([7, 9, 9]), (7, 9, 9)):
        torch.testing.assert_close(A.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=0.5)[0], adv)


def test_grpo_scores_only_count_valid_positions():
    """Deviation: verl sums the whole row, we sum valid positions; equal when rewards outside the mask are 0."""
    gen = torch.Generator().manual_seed(3)
    rewards, mask, index = outcome_batch(gen, 4, 4, 6, torch.float64)
    noisy = rewards + (~mask) * 5.0
    ours, _ = A.compute_grpo_outcome_advantage(noisy, mask, index)
    verl_clean, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask.double(), index)
    torch.testing.assert_close(ours, verl_clean, **TOL64)


def test_grpo_bad_index():
    with pytest.raises(ValueError, match="index has 2 entries"):
        A.compute_grpo_outcome_advantage(torch.zeros(3, 2), torch.ones(3, 2), ["a", "b"])
    with pytest.raises(ValueError, match="index"):
        A.compute_grpo_outcome_advantage(torch.zeros(2, 2), torch.ones(2, 2), [["a"], ["b"]])
    with pytest.raises(ValueError, match="epsilon"):
        A.compute_grpo_outcome_advantage(torch.zeros(2, 2), torch.ones(2, 2), ["a", "b"], epsilon=-1.0)
