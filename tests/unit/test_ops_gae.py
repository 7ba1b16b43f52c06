"""ops.gae (compiled kernels and the torch fallback) against three independent oracles: a float64 loop written
here, algo's compute_gae_advantage_return, and verl 0.9.1's compute_gae_advantage_return (un-whitened advantages
recovered as verl_returns - values at valid positions)."""
from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ppo import ops
from megatron_ppo.algo.advantages import compute_gae_advantage_return as algo_gae

from megatron_ppo.testing.backends import available_backends, kernel_backends, use_backend

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
BACKENDS = available_backends()


def run_gae(backend, rewards, values, mask, gamma, lam):
    """ops.gae on the backend's device; results back on the CPU."""
    with use_backend(backend) as device:
        adv, ret = ops.gae(rewards.to(device), values.to(device), mask.to(device), gamma, lam)
    assert adv.device.type == device.type
    return adv.cpu(), ret.cpu()


def gae_loop_f64(rewards, values, mask, gamma, lam):
    """The recursion in float64 Python scalars: masked steps carry next_value/last_gae; outputs 0 there."""
    r, v, m = rewards.double().tolist(), values.double().tolist(), mask.bool().tolist()
    adv = torch.zeros(rewards.shape, dtype=torch.float64)
    ret = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(len(r)):
        next_value = last_gae = 0.0
        row_adv, row_ret = [0.0] * len(r[b]), [0.0] * len(r[b])  # (per-row lists: T = 8193 rows stay fast)
        for t in reversed(range(len(r[b]))):
            if m[b][t]:
                last_gae = r[b][t] + gamma * next_value - v[b][t] + gamma * lam * last_gae
                next_value = v[b][t]
                row_adv[t], row_ret[t] = last_gae, last_gae + v[b][t]
        adv[b], ret[b] = torch.tensor(row_adv, dtype=torch.float64), torch.tensor(row_ret, dtype=torch.float64)
    return adv, ret


def make_mask(kind: str, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "full":
        return torch.ones(batch, length, dtype=torch.bool)
    if kind == "ragged":  # right padding: response lengths 0..T, at least one full row
        lengths = torch.randint(0, length + 1, (batch,), generator=gen)
        lengths[0] = length
        return torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    if kind == "holes":  # masked tokens inside responses (tool/observation tokens) + padding + an all-masked row
        mask = torch.rand(batch, length, generator=gen) < 0.7
        mask[-1] = False
        return mask
    raise AssertionError(kind)


SHAPES = [(1, 1), (4, 1), (1, 9), (3, 17), (5, 255), (2, 256), (3, 1025), (2, 2500)]


def random_inputs(batch, length, seed, dtype_r=torch.float32, dtype_v=torch.float32, mask_kind="holes"):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen).to(dtype_r)
    values = torch.randn(batch, length, generator=gen).to(dtype_v)
    return rewards, values, make_mask(mask_kind, batch, length, gen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["full", "ragged", "holes"])
def test_gae_matches_float64_loop_and_algo(backend, shape, mask_kind):
    seed = zlib.crc32(repr((shape, mask_kind)).encode()) % 1000
    rewards, values, mask = random_inputs(*shape, seed=seed, mask_kind=mask_kind)
    gamma, lam = 0.99, 0.95
    adv, ret = run_gae(backend, rewards, values, mask, gamma, lam)
    exp_adv, exp_ret = gae_loop_f64(rewards, values, mask, gamma, lam)
    assert adv.dtype == ret.dtype == torch.float32
    assert adv.shape == ret.shape == rewards.shape
    torch.testing.assert_close(adv.double(), exp_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), exp_ret, rtol=1e-5, atol=1e-5)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    algo_adv, algo_ret = algo_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, algo_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, algo_ret, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def verl_gae():
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    return compute_gae_advantage_return


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["full", "ragged", "holes"])
def test_gae_matches_verl_unwhitened(backend, mask_kind, verl_gae):
    rewards, values, mask = random_inputs(6, 40, seed=7, dtype_r=torch.float64, dtype_v=torch.float64,
                                          mask_kind=mask_kind)
    _, verl_returns = verl_gae(rewards, values, mask.double(), 0.97, 0.9)
    adv, ret = run_gae(backend, rewards, values, mask, 0.97, 0.9)
    valid = mask
    torch.testing.assert_close(adv[valid], (verl_returns - values)[valid], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret[valid], verl_returns[valid], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype_r,dtype_v,tol",
    [
        (torch.float32, torch.bfloat16, 1e-5),  # float32 output: only rounding of the final value
        (torch.bfloat16, torch.bfloat16, 2**-7),  # bfloat16 output: one bf16 rounding (kernel) vs per-step (torch)
        (torch.float64, torch.float64, 1e-12),
    ],
)
def test_gae_dtypes(backend, dtype_r, dtype_v, tol):
    rewards, values, mask = random_inputs(4, 300, seed=3, dtype_r=dtype_r, dtype_v=dtype_v)
    adv, ret = run_gae(backend, rewards, values, mask, 1.0, 0.95)
    out_dtype = torch.promote_types(dtype_r, dtype_v)
    assert adv.dtype == ret.dtype == out_dtype
    exp_adv, exp_ret = gae_loop_f64(rewards, values, mask, 1.0, 0.95)
    scale = exp_adv.abs().max().item()
    if backend == "reference" and out_dtype == torch.bfloat16:
        tol = 0.1  # the torch loop rounds to bf16 at each of the 300 steps
    torch.testing.assert_close(adv.double(), exp_adv, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(ret.double(), exp_ret, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gamma,lam", [(0.0, 0.0), (1.0, 1.0), (1.0, 0.0), (0.5, 1.0)])
def test_gae_gamma_lam_edges(backend, gamma, lam):
    rewards, values, mask = random_inputs(3, 50, seed=11)
    adv, ret = run_gae(backend, rewards, values, mask, gamma, lam)
    exp_adv, exp_ret = gae_loop_f64(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), exp_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), exp_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_masked_garbage_never_leaks(backend):
    rewards, values, mask = random_inputs(4, 64, seed=5)
    clean = run_gae(backend, rewards, values, mask, 0.99, 0.95)
    dirty_r, dirty_v = rewards.clone(), values.clone()
    dirty_r[~mask] = float("nan")
    dirty_v[~mask] = float("inf")
    dirty = run_gae(backend, dirty_r, dirty_v, mask, 0.99, 0.95)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_non_contiguous_and_mask_dtypes(backend):
    rewards, values, mask = random_inputs(20, 8, seed=9)
    rt, vt, mt = rewards.t().contiguous().t(), values.t().contiguous().t(), mask.t().contiguous().t()
    assert not rt.is_contiguous()
    exp = gae_loop_f64(rewards, values, mask, 0.9, 0.8)
    with use_backend(backend) as device:
        rt, vt, mt = rt.to(device), vt.to(device), mt.to(device)
        for m in (mt, mt.float(), mt.long(), mt.to(torch.uint8)):
            adv, ret = ops.gae(rt, vt, m, torch.tensor(0.9), 0.8)
            torch.testing.assert_close(adv.double().cpu(), exp[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ret.double().cpu(), exp[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_empty_batch(backend):
    adv, ret = run_gae(backend, torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), 0.9, 0.9)
    assert adv.shape == ret.shape == (0, 5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda r, v, m: (r[0], v, m), "token_level_rewards must have 2 dims"),
        (lambda r, v, m: (r, v[:, :-1], m), "values has shape"),
        (lambda r, v, m: (r, v, m.float() * 2), "response_mask must contain only 0 and 1"),
        (lambda r, v, m: (r, v.masked_fill(m, float("nan")), m), "values has .* NaN/inf"),
        (lambda r, v, m: (r.long(), v, m), "token_level_rewards must be a floating-point tensor"),
    ],
)
def test_gae_bad_input_names_the_argument(backend, mutate, match):
    rewards, values, mask = random_inputs(3, 6, seed=1, mask_kind="full")
    with pytest.raises(ValueError, match=match):
        run_gae(backend, *mutate(rewards, values, mask), 0.99, 0.95)
    with pytest.raises(ValueError, match="gamma must be <= 1"):
        run_gae(backend, rewards, values, mask, 1.5, 0.95)


@pytest.mark.parametrize("backend", kernel_backends())
@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 6),
    length=st.integers(1, 70),
    seed=st.integers(0, 10_000),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    p_valid=st.floats(0.0, 1.0),
)
def test_gae_kernel_property(backend, batch, length, seed, gamma, lam, p_valid):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    mask = torch.rand(batch, length, generator=gen) < p_valid
    adv, ret = run_gae(backend, rewards, values, mask, gamma, lam)
    exp_adv, exp_ret = gae_loop_f64(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), exp_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), exp_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_nonfinite_at_valid_positions_same_error_as_algo(backend):
    rewards, values, mask = random_inputs(4, 30, seed=21, mask_kind="holes")
    rewards[mask.nonzero()[:3].unbind(1)] = float("inf")
    rewards[~mask] = float("nan")  # ignored: masked
    with pytest.raises(ValueError) as algo_error:
        algo_gae(rewards, values, mask, 0.9, 0.9)
    with pytest.raises(ValueError) as ops_error:
        run_gae(backend, rewards, values, mask, 0.9, 0.9)
    assert str(ops_error.value) == str(algo_error.value) == (
        "token_level_rewards has 3 NaN/inf values at valid (mask=1) positions")


# ------------------------------------------------------------------------------------ mask dtypes (one-pass check)

MASK_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
               torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=str)
def test_gae_every_mask_dtype_matches_the_bool_mask(backend, mask_dtype):
    rewards, values, mask = random_inputs(5, 37, seed=13)
    exp = gae_loop_f64(rewards, values, mask, 0.99, 0.95)
    m = mask.to(mask_dtype)
    if mask_dtype.is_floating_point:
        m = torch.where(mask, m, -m.new_zeros(()))  # -0.0 is 0 too
    adv, ret = run_gae(backend, rewards, values, m, 0.99, 0.95)
    torch.testing.assert_close(adv.double(), exp[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), exp[1], rtol=1e-5, atol=1e-5)
    assert torch.all(adv[~mask] == 0)


BAD_MASK_VALUES = [(torch.uint8, 2), (torch.int8, -1), (torch.int16, 256), (torch.int32, 2), (torch.int64, -1),
                   (torch.int64, 1 << 32), (torch.float16, 0.5), (torch.bfloat16, 2.0), (torch.float32, float("nan")),
                   (torch.float32, 1e-30), (torch.float64, -1.0), (torch.float64, float("inf"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dtype,bad", BAD_MASK_VALUES, ids=str)
def test_gae_mask_not_01_same_error_as_algo(backend, mask_dtype, bad):
    """Every non-0/1 value is caught (in the kernel's own pass) with algo's message, even beside NaN rewards."""
    rewards, values, mask = random_inputs(3, 40, seed=2, mask_kind="full")
    m = mask.to(mask_dtype)
    m[1, 17] = bad
    rewards[0, 3] = float("nan")  # the mask error comes first, as in algo
    with pytest.raises(ValueError) as algo_error:
        algo_gae(rewards, values, m, 0.9, 0.9)
    with pytest.raises(ValueError) as ops_error:
        run_gae(backend, rewards, values, m, 0.9, 0.9)
    assert str(ops_error.value) == str(algo_error.value)
    assert str(ops_error.value).startswith("response_mask must contain only 0 and 1 (got other values such as ")


@pytest.mark.parametrize("backend", kernel_backends())
def test_gae_kernel_front_door_makes_no_separate_mask_pass(backend, monkeypatch):
    """Kernel-backed calls validate the mask inside the kernel: the multi-pass algo.checks.mask is never called
    (it cost 8x the kernel for the trainer's float response_mask)."""
    from megatron_ppo.algo import checks

    def forbidden(*args, **kwargs):
        raise AssertionError("ops.gae ran the separate multi-pass mask check")

    monkeypatch.setattr(checks, "mask", forbidden)
    rewards, values, mask = random_inputs(4, 33, seed=4)
    for m in (mask, mask.float(), mask.long(), mask.to(torch.bfloat16)):
        adv, _ = run_gae(backend, rewards, values, m, 0.9, 0.9)
        torch.testing.assert_close(adv.double(), gae_loop_f64(rewards, values, mask, 0.9, 0.9)[0], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_value_checks_off_treats_nonzero_as_valid_like_algo(backend):
    from megatron_ppo.algo import checks

    rewards, values, mask = random_inputs(3, 20, seed=6)
    weird = mask.float() * 2.0  # not 0/1: rejected with checks on; with them off, nonzero selects (algo: m != 0)
    previous = checks.set_value_checks(False)
    try:
        adv, ret = run_gae(backend, rewards, values, weird, 0.9, 0.9)
        exp = algo_gae(rewards, values, weird, 0.9, 0.9)
    finally:
        checks.set_value_checks(previous)
    torch.testing.assert_close(adv, exp[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, exp[1], rtol=1e-5, atol=1e-5)


def test_cpu_kernel_counts_in_one_pass():
    """The raw binding: any mask dtype in, [NaN/inf rewards, NaN/inf values, non-0/1 mask entries] out."""
    kernels = pytest.importorskip("megatron_ppo._kernels_cpu")
    rewards, values, mask = random_inputs(2, 8, seed=8, mask_kind="full")
    rewards[0, 0] = float("inf")
    values[1, 2:4] = float("nan")
    m = mask.float()
    m[1, 5] = 3.0
    m[0, 1] = 0.0
    rewards[0, 1] = float("nan")  # masked: not counted
    _, _, counts = kernels.gae(rewards, values, m, 0.9, 0.9, torch.float32)
    assert counts.tolist() == [1, 2, 1]
