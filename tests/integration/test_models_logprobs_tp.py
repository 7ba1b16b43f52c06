"""Vocab-parallel log-probs/entropy with the vocab sharded over 2 gloo ranks == float64 full-vocab reference."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def _job(rank, world, dtype_name, temperature, impl):
    import torch.distributed as dist

    from megatron_ppo.models.logprobs import vocab_parallel_logprobs_entropy

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(3)
    vocab, padded = 500, 512
    full = 4 * torch.randn(37, padded, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (37,), generator=g)
    targets[:4] = torch.tensor([0, 255, 256, 499])  # both shards' edges
    w1, w2 = torch.randn(2, 37, generator=g, dtype=torch.float64)
    shard = full[:, rank * 256:(rank + 1) * 256].to(dtype).requires_grad_(True)
    group = dist.new_group([0, 1])
    logp, ent = vocab_parallel_logprobs_entropy(shard, targets, vocab_size=vocab, temperature=temperature,
                                                chunk_size=8, tp_group=group, impl=impl)
    (grad,) = torch.autograd.grad((w1 * logp.double() + w2 * ent.double()).sum(), shard)

    ref_in = full.clone().requires_grad_(True)
    lsm = torch.log_softmax(ref_in[:, :vocab] / temperature, dim=-1)
    ref_logp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(lsm.exp() * lsm).sum(-1)
    (ref_grad,) = torch.autograd.grad((w1 * ref_logp + w2 * ref_ent).sum(), ref_in)
    ref_grad = ref_grad[:, rank * 256:(rank + 1) * 256]
    return {
        "logp": (logp.double() - ref_logp).abs().max().item(),
        "ent": (ent.double() - ref_ent).abs().max().item(),
        "grad": (grad.double() - ref_grad).abs().max().item(),
        "pad_grad": grad[:, vocab - rank * 256:].abs().max().item() if rank == 1 else 0.0,
    }


@pytest.mark.parametrize("impl", ["ops", "torch"])
@pytest.mark.parametrize("dtype_name,tol", [("float64", 1e-12), ("float32", 2e-5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_tp2_matches_float64(dist_pool2, dtype_name, tol, temperature, impl):
    for rank, r in enumerate(dist_pool2.run(_job, dtype_name, temperature, impl)):
        assert r["pad_grad"] == 0.0
        for key in ("logp", "ent", "grad"):
            assert r[key] <= tol, f"rank {rank} {dtype_name} T={temperature}: {key} differs by {r[key]}"
