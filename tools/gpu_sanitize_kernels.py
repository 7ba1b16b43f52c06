#!/usr/bin/env python
"""Call every CUDA kernel of megatron_ppo.ops once, at small sizes, for compute-sanitizer (tools/gpu_check.sh,
stage sanitizer): GAE with both algorithms (serial, scan; a row longer than one scan tile, masked holes, an
all-masked row), log-prob + entropy forward and backward (a row split over blocks at V=151936 with leading -inf, an
all -inf TP shard row, a one-hot row, temperature), the TP statistics (partial_stats) and zero rows. Each result is
checked against the torch reference, so the run also fails on a wrong answer, not only on a bad access.

    compute-sanitizer --tool memcheck --error-exitcode 86 python tools/gpu_sanitize_kernels.py
    python tools/gpu_sanitize_kernels.py --device cpu      # the same calls on the CPU kernels (the dry run)

Run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (gpu_check.sh does): every tensor is then its own cudaMalloc, so memcheck
sees an access past a tensor's end instead of landing in the caching allocator's next block.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ppo import ops  # noqa: E402
from megatron_ppo.ops import reference  # noqa: E402
from megatron_ppo.testing.backends import use_backend  # noqa: E402


def close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol, equal_nan=True):
        diff = (got - want).abs().nan_to_num(nan=math.inf).max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{name}: differs from the torch reference (max abs diff {diff}; {got.shape} vs "
                             f"{want.shape})")
    print(f"  {name}: ok {tuple(got.shape)}", flush=True)


def gae_calls(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    for batch, length in ((3, 1), (4, 1025), (2, 2100)):
        rewards, values = torch.randn(batch, length, generator=g), torch.randn(batch, length, generator=g)
        mask = torch.rand(batch, length, generator=g) < 0.8
        mask[-1] = False  # an all-masked row
        want = reference.gae(rewards, values, mask.float(), 0.99, 0.95)
        for algo in ("serial", "scan"):
            os.environ["MEGATRON_PPO_GAE_CUDA_ALGO"] = algo
            adv, ret = ops.gae(rewards.to(device), values.to(device), mask.to(device), 0.99, 0.95)
            close(f"gae[{algo}] {batch}x{length} advantages", adv, want[0], 1e-4)
            close(f"gae[{algo}] {batch}x{length} returns", ret, want[1], 1e-4)
    os.environ.pop("MEGATRON_PPO_GAE_CUDA_ALGO", None)
    adv, _ = ops.gae(torch.zeros(0, 5, device=device), torch.zeros(0, 5, device=device),
                     torch.zeros(0, 5, dtype=torch.bool, device=device), 0.9, 0.9)
    assert adv.shape == (0, 5)
    print("  gae 0x5: ok (empty)", flush=True)


def logprob_calls(device: torch.device) -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 151936
    logits = torch.randn(4, vocab, generator=g) * 3
    logits[0, : vocab // 2] = -math.inf  # every thread's first elements are -inf (the -inf - -inf case)
    logits[1] = -math.inf
    logits[1, 77] = 5.0  # one-hot
    logits[2, 1000:] = -math.inf  # masked tail
    target = torch.tensor([vocab - 1, 77, 10, 12345])
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        want_lp, want_ent = _oracle(x, target)
        leaf = x.to(device).clone().requires_grad_()
        lp, ent = ops.token_logprobs_entropy(leaf, target.to(device), temperature=1.0)
        close(f"logprob fwd {dtype} 4x{vocab} log_probs", lp, want_lp, 2e-3)
        close(f"logprob fwd {dtype} 4x{vocab} entropy", ent, want_ent, 2e-3)
        (lp.sum() - 0.1 * ent.sum()).backward()
        ref_leaf = x.detach().double().requires_grad_()
        r_lp, r_ent = _oracle_autograd(ref_leaf, target)
        (r_lp.sum() - 0.1 * r_ent.sum()).backward()
        close(f"logprob bwd {dtype} 4x{vocab} grad", leaf.grad.float(), ref_leaf.grad.float(), 1e-2)
    # temperature, a short vocabulary, in-place backward
    small = torch.randn(5, 300, generator=g)
    t = torch.randint(0, 300, (5,), generator=g)
    leaf = small.to(device).clone().requires_grad_()
    buf = leaf * 1
    lp, ent = ops.token_logprobs_entropy(buf, t.to(device), temperature=0.7, inplace_backward=True)
    (lp.sum() + ent.sum()).backward()
    ref_leaf = small.double().requires_grad_()
    r_lp, r_ent = _oracle_autograd(ref_leaf / 0.7, t)
    (r_lp.sum() + r_ent.sum()).backward()
    close("logprob temperature 0.7 in-place bwd grad", leaf.grad, ref_leaf.grad, 1e-4)
    # TP statistics: an all -inf shard row gives (-inf, 0, 0, .); zero rows give the empty result
    shard = logits[:, vocab // 2:].contiguous()
    shard[1] = -math.inf
    stats = ops.partial_stats(shard.to(device), target.to(device), vocab // 2)
    want = reference.lse_partials(shard, target, vocab // 2)
    close("partial_stats 4x75968 (an all -inf row)", stats, want, 1e-3)
    assert stats[0, 1].item() == -math.inf and stats[1, 1].item() == 0 and stats[2, 1].item() == 0
    empty = ops.partial_stats(torch.zeros(0, 1000, device=device), torch.zeros(0, dtype=torch.long, device=device))
    assert empty.shape == (4, 0)
    lp, ent = ops.token_logprobs_entropy(torch.zeros(0, 1000, device=device), torch.zeros(0, dtype=torch.long,
                                                                                         device=device))
    assert lp.shape == ent.shape == (0,)
    print("  logprob / partial_stats 0x1000: ok (empty)", flush=True)


def _oracle(x: torch.Tensor, target: torch.Tensor):
    with torch.no_grad():
        return _oracle_autograd(x.double(), target)


def _oracle_autograd(x: torch.Tensor, target: torch.Tensor):
    logp_all = torch.log_softmax(x, dim=-1)
    p = logp_all.exp()
    ent = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)  # 0 * -inf := 0, with a finite gradient
    return logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1), ent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    backend = args.device
    if backend == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU")
    with use_backend(backend) as device:  # kernels mode: a missing extension is an error, not the fallback
        assert ops.backend(device) == backend, ops.unavailable_reason(device.type)
        print(f"gpu_sanitize_kernels: {backend} kernels on {device}", flush=True)
        gae_calls(device)
        logprob_calls(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
    print("gpu_sanitize_kernels: all calls done and checked", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
