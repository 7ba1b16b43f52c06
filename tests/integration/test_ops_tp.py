"""ops.token_logprobs_entropy(tp_group=...) on 2 gloo ranks, each holding half of a padded vocabulary: log-probs,
entropy and each rank's gradient equal the float64 full-vocabulary reference (kernels: CPU extension)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def _job(rank, world, dtype_name, temperature, mode):
    from megatron_ppo import ops

    previous = ops.set_mode(mode)  # the pool's ranks outlive this job: restore the mode afterwards
    try:
        return _compare(rank, dtype_name, temperature)
    finally:
        ops.set_mode(previous)


def _compare(rank, dtype_name, temperature):
    import torch.distributed as dist

    from megatron_ppo import ops

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(5)
    vocab, shard = 777, 512
    full = 3 * torch.randn(29, 2 * shard, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (29,), generator=g)
    targets[:4] = torch.tensor([0, shard - 1, shard, vocab - 1])  # both shards' edges
    w1, w2 = torch.randn(2, 29, generator=g, dtype=torch.float64)
    local = full[:, rank * shard:(rank + 1) * shard].to(dtype).requires_grad_(True)
    group = dist.new_group([0, 1])
    logp, ent = ops.token_logprobs_entropy(local, targets, vocab_start_index=rank * shard, vocab_size=vocab,
                                           temperature=temperature, tp_group=group)
    (grad,) = torch.autograd.grad((w1 * logp.double() + w2 * ent.double()).sum(), local)

    ref = full.to(dtype).double().requires_grad_(True)
    lsm = torch.log_softmax(ref[:, :vocab] / temperature, dim=-1)
    ref_logp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(lsm.exp() * lsm).sum(-1)
    (ref_grad,) = torch.autograd.grad((w1 * ref_logp + w2 * ref_ent).sum(), ref)
    ref_grad = ref_grad[:, rank * shard:(rank + 1) * shard]
    return {
        "backend": ops.backend("cpu"),
        "logp": (logp.double() - ref_logp).abs().max().item(),
        "ent": (ent.double() - ref_ent).abs().max().item(),
        "grad": ((grad.double() - ref_grad).abs().max() / ref_grad.abs().max()).item(),
        "pad_grad": grad[:, vocab - shard:].abs().max().item() if rank == 1 else 0.0,
    }


@pytest.mark.parametrize("mode", ["kernels", "reference"])
@pytest.mark.parametrize("dtype_name,tol,grad_tol", [("float64", 1e-12, 1e-12), ("float32", 2e-5, 1e-5),
                                                      ("bfloat16", 2e-5, 2**-8)])
def test_tp2_matches_full_vocab_float64(dist_pool2, mode, dtype_name, tol, grad_tol):
    for rank, r in enumerate(dist_pool2.run(_job, dtype_name, 0.9, mode)):
        assert r["backend"] == ("cpu" if mode == "kernels" else "reference")
        assert r["pad_grad"] == 0.0
        assert r["logp"] <= tol and r["ent"] <= tol, f"rank {rank} {dtype_name}: {r}"
        assert r["grad"] <= grad_tol, f"rank {rank} {dtype_name}: {r}"
