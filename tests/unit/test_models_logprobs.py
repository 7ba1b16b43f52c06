"""Vocab-parallel log-probs/entropy on one rank against float64 full-vocab references (forward and backward)."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.logprobs import next_token_targets, vocab_parallel_logprobs_entropy


def _reference(logits, targets, vocab, temperature):
    x = logits[..., :vocab].double() / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


@pytest.mark.parametrize("impl", ["torch", "ops"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [5, 4096])
def test_matches_float64_reference_forward_and_backward(impl, dtype, temperature, chunk):
    g = torch.Generator().manual_seed(0)
    vocab, padded = 300, 384
    logits = (3 * torch.randn(4, 9, padded, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (4, 9), generator=g)
    w1, w2 = torch.randn(2, 4, 9, generator=g, dtype=torch.float64)
    logp, ent = vocab_parallel_logprobs_entropy(logits, targets, vocab_size=vocab, temperature=temperature,
                                                chunk_size=chunk, impl=impl)
    ref_in = logits.detach().double().requires_grad_(True)  # the reference sees the same (rounded) logits
    ref_logp, ref_ent = _reference(ref_in, targets, vocab, temperature)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    assert logp.shape == ent.shape == (4, 9)
    torch.testing.assert_close(logp.double(), ref_logp, atol=tol, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=tol, rtol=0)
    (grad,) = torch.autograd.grad((w1 * logp.double() + w2 * ent.double()).sum(), logits)
    (ref_grad,) = torch.autograd.grad((w1 * ref_logp + w2 * ref_ent).sum(), ref_in)
    torch.testing.assert_close(grad.double(), ref_grad, atol=tol, rtol=0)
    assert grad[..., vocab:].abs().max() == 0  # padded vocab gets no gradient


@pytest.mark.parametrize("impl", ["torch", "ops"])
def test_padding_never_contributes_even_with_huge_padded_logits(impl):
    logits = torch.zeros(2, 8, dtype=torch.float64)
    logits[:, 6:] = 1e4  # padding rows of the output layer may hold anything
    logp, ent = vocab_parallel_logprobs_entropy(logits, torch.tensor([0, 5]), vocab_size=6, impl=impl)
    torch.testing.assert_close(logp, torch.full((2,), -torch.log(torch.tensor(6.0, dtype=torch.float64)).item(),
                                                  dtype=torch.float64))
    torch.testing.assert_close(ent, torch.full((2,), torch.log(torch.tensor(6.0)).item(), dtype=torch.float64))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="leading dims"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), vocab_size=5)
    with pytest.raises(ValueError, match="targets must lie"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 4), torch.tensor([0, 3]), vocab_size=3)
    with pytest.raises(ValueError, match="impl"):
        vocab_parallel_logprobs_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), impl="cuda")


def test_ops_and_torch_paths_agree_in_float64():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(50, 130, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 100, (50,), generator=g)
    a = vocab_parallel_logprobs_entropy(logits, targets, vocab_size=100, temperature=0.8, impl="ops")
    b = vocab_parallel_logprobs_entropy(logits, targets, vocab_size=100, temperature=0.8, impl="torch")
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_next_token_targets_padded_and_packed():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    t, v = next_token_targets(ids)
    assert t.tolist() == [[2, 3, 4, 0], [6, 7, 8, 0]]
    assert v.tolist() == [[True, True, True, False]] * 2
    packed = torch.tensor([[1, 2, 3, 9, 8, 7, 6]])
    t, v = next_token_targets(packed, torch.tensor([0, 3, 7], dtype=torch.int32))
    assert t.tolist() == [[2, 3, 0, 8, 7, 6, 0]]
    assert v.tolist() == [[True, True, False, True, True, True, False]]
