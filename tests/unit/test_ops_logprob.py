"""ops.token_logprobs_entropy and its TP pieces (compiled kernels and the torch fallback) against a float64
log_softmax oracle, verl 0.9.1's logprobs_from_logits / entropy_from_logits, and torch autograd gradients;
gradcheck in float64 on the CPU kernel."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_ppo import ops
from megatron_ppo.ops.reference import logprobs_entropy_naive
from megatron_ppo.testing.backends import available_backends, kernel_backends, use_backend

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
BACKENDS = available_backends()
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}  # vs float64 on the same (rounded) logits


def oracle(logits: torch.Tensor, target: torch.Tensor):
    """float64 log_softmax on the exact logits values (bf16 logits upcast losslessly)."""
    logp_all = torch.log_softmax(logits.double(), dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    entropy = -torch.where(p == 0, torch.zeros_like(p), p * logp_all).sum(-1)
    return logp, entropy


def random_logits(shape, vocab, dtype, seed, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    return logits, target


def run(backend, logits, target, **kwargs):
    with use_backend(backend) as device:
        logp, ent = ops.token_logprobs_entropy(logits.to(device), target.to(device), **kwargs)
    assert logp.device.type == device.type
    return logp.cpu(), ent.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "shape,vocab",
    [((1,), 1), ((3,), 2), ((2, 1), 7), ((1, 5), 4095), ((4,), 4096), ((2, 3), 4097), ((5,), 10007), ((1,), 151936)],
)
def test_forward_matches_float64_oracle(backend, dtype, shape, vocab):
    logits, target = random_logits(shape, vocab, dtype, seed=vocab)
    logp, ent = run(backend, logits, target)
    exp_logp, exp_ent = oracle(logits, target)
    assert logp.shape == ent.shape == target.shape
    assert logp.dtype == ent.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = TOL[dtype]
    torch.testing.assert_close(logp.double(), exp_logp, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(ent.double(), exp_ent, rtol=tol, atol=tol * 10)


@pytest.fixture(scope="module")
def verl_fns():
    from verl.utils import torch_functional as verl_F

    return verl_F.logprobs_from_logits, verl_F.entropy_from_logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_verl(backend, dtype, verl_fns):
    verl_logprobs, verl_entropy = verl_fns
    logits, target = random_logits((3, 9), 3001, dtype, seed=1)
    logp, ent = run(backend, logits, target)
    exp_logp = verl_logprobs(logits, target).float()
    exp_ent = verl_entropy(logits.float()).float()  # verl's entropy in bf16 loses ~3 digits; compare on fp32 inputs
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # verl returns bf16 log-probs for bf16 logits
    torch.testing.assert_close(logp, exp_logp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, exp_ent, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_vocab_and_extreme_logits(backend):
    logits, target = random_logits((6,), 300, torch.float32, seed=2)
    logits[0, 100:] = float("-inf")  # padded / banned vocabulary entries
    target[0] = 5
    logits[1] = float("-inf")
    logits[1, 7] = 3.0  # a one-hot distribution: log p = 0, entropy = 0
    target[1] = 7
    logits[2] += 1e4  # large offsets: only the max-shift keeps this finite
    logits[3] *= 100.0  # near one-hot
    logits[4, 0] = 80.0  # exp(80) overflows float32 without the shift
    logp, ent = run(backend, logits, target)
    exp_logp, exp_ent = oracle(logits, target)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(logp.double(), exp_logp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent.double(), exp_ent, rtol=1e-5, atol=1e-4)
    assert logp[1] == 0 and ent[1] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_propagate(backend):
    logits, target = random_logits((3,), 50, torch.float32, seed=3)
    logits[1, 10] = float("nan")
    logp, ent = run(backend, logits, target)
    assert torch.isnan(logp[1]) and torch.isnan(ent[1])
    assert torch.isfinite(logp[[0, 2]]).all() and torch.isfinite(ent[[0, 2]]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["both", "logp_only", "entropy_only"])
def test_backward_matches_autograd(backend, dtype, weights):
    logits, target = random_logits((2, 5), 4099, dtype, seed=4)
    gen = torch.Generator().manual_seed(0)
    w_lp, w_ent = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    ref = logits.detach().to(torch.float64, copy=True).requires_grad_()  # its own leaf, also for float64
    r_lp, r_ent = oracle_autograd(ref, target)
    loss = ((r_lp * w_lp.double()).sum() if weights != "entropy_only" else 0) + (
        (r_ent * w_ent.double()).sum() if weights != "logp_only" else 0)
    loss.backward()
    with use_backend(backend) as device:
        x = logits.detach().to(device, copy=True).requires_grad_()
        lp, ent = ops.token_logprobs_entropy(x, target.to(device))
        loss = ((lp * w_lp.to(device)).sum() if weights != "entropy_only" else 0) + (
            (ent * w_ent.to(device)).sum() if weights != "logp_only" else 0)
        loss.backward()
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    # bf16 gradients carry one bf16 rounding (relative 2^-8) of each element
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(x.grad.cpu().double(), ref.grad, rtol=tol, atol=tol * ref.grad.abs().max().item())


def oracle_autograd(x, target):
    logp_all = torch.log_softmax(x, dim=-1)
    return logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("vocab", [1, 3, 17])
def test_gradcheck_float64(backend, vocab):
    logits, target = random_logits((2, 3), vocab, torch.float64, seed=vocab, scale=1.5)
    with use_backend(backend) as device:
        x = logits.detach().to(device, copy=True).requires_grad_()
        t = target.to(device)
        assert torch.autograd.gradcheck(lambda z: ops.token_logprobs_entropy(z, t), (x,), eps=1e-6, atol=1e-8)
        assert torch.autograd.gradcheck(lambda z: ops.token_logprobs_entropy(z, t)[1], (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_gives_the_same_gradient(backend):
    logits, target = random_logits((7,), 5000, torch.bfloat16, seed=5)
    with use_backend(backend) as device:
        grads = []
        for inplace in (False, True):
            leaf = logits.to(device).requires_grad_()
            x = leaf * 1  # a non-leaf buffer the in-place backward may overwrite
            lp, ent = ops.token_logprobs_entropy(x, target.to(device), inplace_backward=inplace)
            (lp.sum() - 0.1 * ent.sum()).backward()
            grads.append(leaf.grad.cpu())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_logits(backend):
    full, target = random_logits((3, 6), 301, torch.float32, seed=6)
    sliced = full[:, :-1]  # the usual logits[:, :-1] shift: not viewable as [N, V]
    logp, ent = run(backend, sliced, target[:, 1:])
    exp_logp, exp_ent = oracle(sliced, target[:, 1:])
    torch.testing.assert_close(logp.double(), exp_logp, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), exp_ent, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_shards", [2, 3])
def test_tp_decomposition_reassembles_full_vocab(backend, n_shards):
    """Shard the vocabulary as Megatron does, compute each rank's partial stats, do the two all-reduces by hand:
    the result equals the full-vocabulary op, and each rank's backward equals its slice of the full gradient."""
    vocab = 3 * 1031
    logits, target = random_logits((9,), vocab, torch.float32, seed=8)
    shard = vocab // n_shards
    logits[:4, shard:] = float("-inf")  # rows whose later shards are all -inf
    with use_backend(backend) as device:
        x, t = logits.to(device), target.to(device)
        full_logp, full_ent = ops.token_logprobs_entropy(x, t)
        stats = [ops.partial_stats(x[:, r * shard:(r + 1) * shard], t, r * shard) for r in range(n_shards)]
        global_max = torch.stack([s[0] for s in stats]).amax(0)
        summed = sum(ops.rebase_stats(s, global_max) for s in stats)
        logp, ent, log_z = ops.finish_stats(global_max, summed)
        torch.testing.assert_close(logp, full_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, full_ent, rtol=1e-5, atol=1e-5)
        g_lp, g_ent = torch.ones_like(logp), torch.full_like(ent, -0.3)
        leaf = x.clone().requires_grad_()
        a, b = ops.token_logprobs_entropy(leaf, t)
        (a * g_lp + b * g_ent).sum().backward()
        for r in range(n_shards):
            part = ops.logprobs_entropy_backward(x[:, r * shard:(r + 1) * shard], t, r * shard, log_z, ent, g_lp,
                                                 g_ent)
            torch.testing.assert_close(part, leaf.grad[:, r * shard:(r + 1) * shard], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_stats_layout(backend):
    logits, target = random_logits((4,), 40, torch.float32, seed=9)
    with use_backend(backend) as device:
        stats = ops.partial_stats(logits[:, 10:30].to(device), target.to(device), 10).cpu()
    x = logits[:, 10:30].double()
    m = x.amax(-1)
    torch.testing.assert_close(stats[0].double(), m)
    torch.testing.assert_close(stats[1].double(), torch.exp(x - m[:, None]).sum(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats[2].double(), (torch.exp(x - m[:, None]) * (x - m[:, None])).sum(-1),
                               rtol=1e-6, atol=1e-6)
    local = target - 10
    inside = (local >= 0) & (local < 20)
    expected_target = torch.where(inside, x.gather(1, local.clamp(0, 19)[:, None])[:, 0], torch.zeros(4).double())
    torch.testing.assert_close(stats[3].double(), expected_target)


def test_reference_chunking_matches_unchunked():
    from megatron_ppo.ops import reference

    logits, target = random_logits((33,), 257, torch.float32, seed=10)
    whole = reference.lse_partials(logits, target, 0)
    chunked = reference.lse_partials(logits, target, 0, chunk_elements=257 * 4)  # 4 rows per chunk
    torch.testing.assert_close(chunked, whole)


@pytest.mark.parametrize("backend", BACKENDS)
def test_naive_and_fused_agree_on_autograd(backend):
    logits, target = random_logits((4, 3), 1000, torch.float32, seed=11)
    leaf_a, leaf_b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    a_lp, a_ent = logprobs_entropy_naive(leaf_a, target)
    (a_lp.sum() + a_ent.sum()).backward()
    with use_backend(backend) as device:
        x = leaf_b.to(device)
        b_lp, b_ent = ops.token_logprobs_entropy(x, target.to(device))
        (b_lp.sum() + b_ent.sum()).backward()
    torch.testing.assert_close(leaf_b.grad, leaf_a.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x, t: (x, t.clamp_max(0) - 1), r"target_ids must lie in \[0, 50\)"),
        (lambda x, t: (x, t + 50), r"target_ids must lie in \[0, 50\)"),
        (lambda x, t: (x, t[:, :-1]), "target_ids has shape"),
        (lambda x, t: (x, t.float()), "target_ids must be an int64/int32 tensor"),
        (lambda x, t: (x.long(), t), "logits must be a floating-point tensor"),
        (lambda x, t: (x.half(), t), "logits must be float32, bfloat16 or float64"),
        (lambda x, t: (x[..., :0], t), "empty vocabulary"),
    ],
)
def test_bad_input_names_the_argument(backend, make, match):
    logits, target = random_logits((2, 3), 50, torch.float32, seed=12)
    with pytest.raises(ValueError, match=match):
        run(backend, *make(logits, target))


def test_vocab_start_without_group_is_rejected():
    logits, target = random_logits((2,), 10, torch.float32, seed=13)
    with pytest.raises(ValueError, match="vocab_start_index must be 0 without a tp_group"):
        ops.token_logprobs_entropy(logits, target, vocab_start_index=10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_temperature_is_folded_in(backend, dtype, temperature):
    logits, target = random_logits((3, 4), 2051, dtype, seed=14)
    gen = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(3, 4, generator=gen,
                                                                                       dtype=torch.float64)
    ref = logits.detach().to(torch.float64, copy=True).requires_grad_()  # its own leaf, also for float64
    r_lp, r_ent = oracle_autograd(ref / temperature, target)
    ((r_lp * w_lp).sum() + (r_ent * w_ent).sum()).backward()
    with use_backend(backend) as device:
        x = logits.detach().to(device, copy=True).requires_grad_()
        lp, ent = ops.token_logprobs_entropy(x, target.to(device), temperature=temperature)
        ((lp.double() * w_lp.to(device)).sum() + (ent.double() * w_ent.to(device)).sum()).backward()
    tol = 1e-10 if dtype == torch.float64 else 3e-5
    torch.testing.assert_close(lp.cpu().double(), r_lp.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ent.cpu().double(), r_ent.detach(), rtol=tol, atol=tol)
    gtol = tol if dtype != torch.bfloat16 else 2**-8
    torch.testing.assert_close(x.grad.cpu().double(), ref.grad, rtol=gtol, atol=gtol * ref.grad.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_vocab_padding_is_excluded_and_gets_zero_grad(backend, inplace):
    vocab, padded = 1000, 1024
    logits, target = random_logits((5,), padded, torch.float32, seed=15)
    target %= vocab
    logits[:, vocab:] = 50.0  # garbage in the padding would dominate the softmax if it were counted
    ref = logits[:, :vocab].double().requires_grad_()
    r_lp, r_ent = oracle_autograd(ref, target)
    (r_lp.sum() + 0.5 * r_ent.sum()).backward()
    with use_backend(backend) as device:
        leaf = logits.to(device).requires_grad_()
        x = leaf * 1
        lp, ent = ops.token_logprobs_entropy(x, target.to(device), vocab_size=vocab, inplace_backward=inplace)
        (lp.sum() + 0.5 * ent.sum()).backward()
    torch.testing.assert_close(lp.cpu().double(), r_lp.detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.cpu().double(), r_ent.detach(), rtol=2e-5, atol=2e-5)
    grad = leaf.grad.cpu()
    assert torch.all(grad[:, vocab:] == 0)
    torch.testing.assert_close(grad[:, :vocab].double(), ref.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"target_ids must lie in \[0, 1000\)"):
        run(backend, logits, torch.full_like(target, vocab + 3), vocab_size=vocab)
    with pytest.raises(ValueError, match="vocab_size 2000 exceeds"):
        run(backend, logits, target, vocab_size=2000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_shards_with_padding_and_temperature(backend):
    """Megatron layout: 2 equal shards of a padded vocabulary, the padding all in the last shard (one shard may
    hold no real column at all: its statistics are the neutral (-inf, 0, 0, 0))."""
    vocab, shard, temperature = 700, 512, 0.8
    logits, target = random_logits((6,), 2 * shard, torch.float32, seed=16)
    target %= vocab
    with use_backend(backend) as device:
        x, t = logits.to(device), target.to(device)
        parts = []
        for rank in range(2):
            n_valid = min(max(vocab - rank * shard, 0), shard)
            parts.append(ops.partial_stats(x[:, rank * shard:rank * shard + n_valid], t, rank * shard,
                                           temperature=temperature))
        empty = ops.partial_stats(x[:, :0], t, 0)
        gmax = torch.maximum(parts[0][0], parts[1][0])
        logp, ent, _ = ops.finish_stats(gmax, ops.rebase_stats(parts[0], gmax) + ops.rebase_stats(parts[1], gmax))
    exp_lp, exp_ent = oracle(logits[:, :vocab] / temperature, target)
    torch.testing.assert_close(logp.cpu().double(), exp_lp, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ent.cpu().double(), exp_ent, rtol=2e-5, atol=2e-5)
    assert torch.all(empty[0].cpu() == float("-inf")) and torch.all(empty[1:].cpu() == 0)


def test_bad_temperature():
    logits, target = random_logits((2,), 10, torch.float32, seed=17)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be"):
            ops.token_logprobs_entropy(logits, target, temperature=bad)
