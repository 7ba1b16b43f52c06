"""The edge rows of issue 23 through the ops front door on every kernel backend (cpu here; cuda where a GPU is
visible, run by tools/gpu_check.sh): the device-side counterparts of tests/unit/test_ops_cuda_host.py, which runs
the same per-element functions on the host.

Rows: -inf first (every thread's first elements -inf), all -inf (a TP shard's row: statistics (-inf, 0, 0, .)),
one-hot, NaN, zero rows [0, V] (SIGFPE in the old workspace sizing), one row x 151936 split over blocks with its
backward, a [1, V] row whose stride(0) is below V (torch calls it contiguous), GAE at T = 1 and 8193 with holes.
Every result is compared with a float64 oracle, and on cuda with the CPU kernel too.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_ppo import ops
from megatron_ppo.ops import reference
from megatron_ppo.testing.backends import kernel_backends, use_backend

BACKENDS = kernel_backends()
V_QWEN = 151936


def oracle(x: torch.Tensor, target: torch.Tensor):
    """float64 log-prob and entropy, differentiable with finite gradients at -inf logits (0 * -inf := 0)."""
    logp_all = torch.log_softmax(x.double(), dim=-1)
    p = logp_all.exp()
    entropy = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)
    return logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1), entropy


def on_backend(backend, fn, *tensors):
    """fn(*tensors moved to the backend's device) under that backend; results back on the CPU."""
    with use_backend(backend) as device:
        out = fn(*(t.to(device) for t in tensors))
    return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()


def cpu_kernel(fn, *tensors):
    return on_backend("cpu", fn, *tensors)


def edge_rows(vocab: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, vocab, generator=g, dtype=torch.float64) * 3).to(dtype)
    x[0, : vocab // 2] = -math.inf  # -inf first: the first elements every thread sees
    x[1] = -math.inf
    x[1, vocab // 3] = 4.0  # one-hot
    x[2, 7:] = -math.inf  # masked tail
    x[3, vocab - 1] = 90.0  # exp overflows without the max shift
    target = torch.tensor([vocab - 1, vocab // 3, 3, 0, vocab // 2])
    return x, target


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [4097, V_QWEN])
def test_neg_inf_and_one_hot_rows_forward_and_backward(backend, dtype, vocab):
    x, target = edge_rows(vocab, dtype)

    def fwd_bwd(logits, t):
        leaf = logits.clone().requires_grad_()
        lp, ent = ops.token_logprobs_entropy(leaf, t)
        (lp.sum() - 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), leaf.grad

    lp, ent, grad = on_backend(backend, fwd_bwd, x, target)
    ref = x.double().requires_grad_()
    r_lp, r_ent = oracle(ref, target)
    (r_lp.sum() - 0.3 * r_ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-4)
    assert lp[1] == 0 and ent[1] == 0  # one-hot
    gtol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(grad.double(), ref.grad, rtol=gtol, atol=gtol)
    if backend != "cpu":
        c_lp, c_ent, c_grad = cpu_kernel(fwd_bwd, x, target)
        torch.testing.assert_close(lp, c_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, c_ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.float(), c_grad.float(), rtol=gtol, atol=gtol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_neg_inf_shard_rows_give_neutral_statistics(backend, dtype):
    """A TP shard whose row is all -inf: (-inf, 0, 0, 0), never NaN (the SUM all-reduce would spread it)."""
    x, target = edge_rows(V_QWEN, dtype, seed=1)
    shard = x[:, V_QWEN // 2:].contiguous()
    shard[1] = -math.inf
    shard[4] = -math.inf
    stats = on_backend(backend, lambda s, t: ops.partial_stats(s, t, V_QWEN // 2), shard, target)
    assert not torch.isnan(stats).any()
    for row in (1, 4):
        assert stats[0, row] == -math.inf and stats[1, row] == 0 and stats[2, row] == 0
    torch.testing.assert_close(stats, reference.lse_partials(shard, target, V_QWEN // 2), rtol=1e-5, atol=1e-5)
    if backend != "cpu":
        torch.testing.assert_close(stats, cpu_kernel(lambda s, t: ops.partial_stats(s, t, V_QWEN // 2), shard,
                                                     target), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_row_stays_in_its_row(backend):
    x, target = edge_rows(V_QWEN, torch.float32, seed=2)
    x[2, 3] = float("nan")
    lp, ent = on_backend(backend, lambda a, b: ops.token_logprobs_entropy(a, b), x, target)
    assert torch.isnan(lp[2]) and torch.isnan(ent[2])
    others = [0, 1, 3, 4]
    assert torch.isfinite(lp[others]).all() and torch.isfinite(ent[others]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [1, 1000, V_QWEN])
def test_zero_rows_give_the_empty_result(backend, vocab):
    x, t = torch.zeros(0, vocab), torch.zeros(0, dtype=torch.long)

    def run(a, b):
        leaf = a.clone().requires_grad_()
        lp, ent = ops.token_logprobs_entropy(leaf, b)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), leaf.grad, ops.partial_stats(a, b)

    lp, ent, grad, stats = on_backend(backend, run, x, t)
    assert lp.shape == ent.shape == (0,) and grad.shape == (0, vocab) and stats.shape == (4, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_of_the_full_vocabulary_split_over_blocks(backend, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1, V_QWEN, generator=g, dtype=torch.float64) * 5).to(dtype)
    target = torch.tensor([V_QWEN - 7])

    def fwd_bwd(logits, t):
        leaf = logits.clone().requires_grad_()
        lp, ent = ops.token_logprobs_entropy(leaf, t, temperature=0.9)
        (lp.sum() + 0.5 * ent.sum()).backward()
        return lp.detach(), ent.detach(), leaf.grad

    lp, ent, grad = on_backend(backend, fwd_bwd, x, target)
    ref = x.double().requires_grad_()
    r_lp, r_ent = oracle(ref / 0.9, target)
    (r_lp.sum() + 0.5 * r_ent.sum()).backward()
    torch.testing.assert_close(lp.double(), r_lp.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent.double(), r_ent.detach(), rtol=1e-5, atol=1e-4)
    gtol = 1e-6 if dtype == torch.float32 else 2**-8 * ref.grad.abs().max().item()
    torch.testing.assert_close(grad.double(), ref.grad, rtol=1e-3, atol=gtol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_row_whose_stride_is_below_the_vocabulary(backend):
    """torch calls a [1, V] tensor with stride(0) < V contiguous; the kernels must accept it (bug 6)."""
    base = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    target = torch.tensor([123])

    def run(b, t):
        row = b.as_strided((1, 4999), (1, 1))  # stride(0) = 1 < V
        assert row.is_contiguous()
        return ops.token_logprobs_entropy(row, t)

    lp, ent = on_backend(backend, run, base, target)
    r_lp, r_ent = oracle(base[:4999].unsqueeze(0), target)
    torch.testing.assert_close(lp.double(), r_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-5, atol=1e-5)


def gae_f64(rewards, values, mask, gamma, lam):
    r, v, m = rewards.double(), values.double(), mask.bool()
    adv = torch.zeros_like(r)
    nxt = torch.zeros(r.shape[0], dtype=torch.float64)
    last = torch.zeros(r.shape[0], dtype=torch.float64)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nxt - v[:, t]
        new_last = delta + gamma * lam * last
        last = torch.where(m[:, t], new_last, last)
        nxt = torch.where(m[:, t], v[:, t], nxt)
        adv[:, t] = torch.where(m[:, t], last, torch.zeros_like(last))
    return adv, torch.where(m, adv + v, torch.zeros_like(adv))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [1, 8193])
@pytest.mark.parametrize("algo", ["serial", "scan"])
def test_gae_at_one_and_8193_steps_with_holes(backend, length, algo, monkeypatch):
    monkeypatch.setenv("MEGATRON_PPO_GAE_CUDA_ALGO", algo)  # read per call on cuda; ignored by the CPU kernel
    g = torch.Generator().manual_seed(length)
    rewards, values = torch.randn(3, length, generator=g), torch.randn(3, length, generator=g)
    mask = torch.rand(3, length, generator=g) < 0.7
    mask[2] = False
    mask[0, 0] = True
    adv, ret = on_backend(backend, lambda a, b, c: ops.gae(a, b, c, 0.99, 0.95), rewards, values, mask)
    e_adv, e_ret = gae_f64(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv.double(), e_adv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ret.double(), e_ret, rtol=1e-4, atol=1e-4)
    if backend != "cpu":
        c_adv, c_ret = cpu_kernel(lambda a, b, c: ops.gae(a, b, c, 0.99, 0.95), rewards, values, mask)
        torch.testing.assert_close(adv, c_adv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret, c_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a CUDA device and the CUDA extension")
def test_cuda_bindings_refuse_cpu_tensors_with_a_message():
    """bindings.cpp checks is_cuda before it builds the CUDAGuard: a message naming the tensor, not an assert."""
    import importlib

    ext = importlib.import_module("megatron_ppo._kernels_cuda")
    x, t = torch.randn(2, 10), torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="logits must be a CUDA tensor"):
        ext.lse_partials(x, t, 0, 1.0)
    with pytest.raises(RuntimeError, match="token_level_rewards must be a CUDA tensor"):
        ext.gae(x, x, torch.ones(2, 10), 0.9, 0.9, torch.float32, 0)
