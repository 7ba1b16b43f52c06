"""Benchmark the Megatron model layer: actor fwd+bwd tokens/s at TP1 vs TP2, generation with vs without KV cache.

    .venv/bin/python tools/bench_models.py [--out docs/bench/models.md] [--quick]

Each measurement runs in freshly spawned ranks (gloo on CPU), side by side in one invocation, and is printed as a
markdown section (written to --out). On a CUDA machine the same script measures bf16 on the GPU (TP1 only,
one rank) and reports MFU against --peak-tflops.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ppo.models.arch import ModelArch, tiny_arch  # noqa: E402
from megatron_ppo.parallel.launch import LocalWorkerPool  # noqa: E402

GEN_ARCH = dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4,
                vocab_size=4096, max_position_embeddings=1024)
GPU_1B_ARCH = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, num_query_groups=8,
                   vocab_size=128256, max_position_embeddings=4096, rotary_base=500000.0, tie_word_embeddings=True)


def train_flops_per_token(arch: ModelArch, seq_len: int) -> float:
    """6 * params (matmuls, fwd+bwd) + causal attention scores/values (12 * L * h * s / 2 per token)."""
    lookup_only = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size  # input embedding: no matmul
    dense = 6 * (arch.num_parameters() - lookup_only)
    attn = 12 * arch.num_layers * arch.num_attention_heads * arch.head_dim * seq_len / 2
    return dense + attn


def _fwd_bwd_job(rank, world, tp, arch_kw, seqs_per_mb, seq_len, n_mb, iters, dtype_name):
    from megatron_ppo import parallel
    from megatron_ppo.models.forward import pack_sequences
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.logprobs import next_token_targets, vocab_parallel_logprobs_entropy
    from megatron_ppo.models.schedule import forward_backward

    arch = ModelArch(**arch_kw)
    dtype = getattr(torch, dtype_name)
    parallel.initialize(tp=tp, seed=1)
    try:
        model = build_gpt_model(arch, "actor", params_dtype=dtype)
        g = torch.Generator().manual_seed(0)
        dev = next(model.parameters()).device
        mbs = []
        for _ in range(n_mb):
            ids, cu = pack_sequences([torch.randint(0, arch.vocab_size, (seq_len,), generator=g)
                                      for _ in range(seqs_per_mb)])
            mbs.append({"input_ids": ids.to(dev), "cu_seqlens": cu.to(dev)})

        def loss_fn(logits, batch):
            t, v = next_token_targets(batch["input_ids"], batch["cu_seqlens"])
            logp, ent = vocab_parallel_logprobs_entropy(logits, t, vocab_size=arch.vocab_size)
            return -((logp + 0.01 * ent) * v).sum() / v.sum(), {}

        times = []
        for i in range(iters + 2):
            model.zero_grad()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward_backward([model], mbs, loss_fn)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i >= 2:  # warm-up
                times.append(time.perf_counter() - t0)
        return {"tokens": n_mb * seqs_per_mb * seq_len, "best_s": min(times), "median_s": statistics.median(times)}
    finally:
        parallel.destroy(destroy_process_group=False)


def _generation_job(rank, world, arch_kw, batch, prompt_len, response_len, use_kv_cache):
    from megatron_ppo import parallel
    from megatron_ppo.rollout.generation import SamplingParams, generate
    from megatron_ppo.models.gpt import build_gpt_model

    arch = ModelArch(**arch_kw)
    parallel.initialize(seed=1)
    try:
        model = build_gpt_model(arch, "actor")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, arch.vocab_size, (prompt_len,), generator=g) for _ in range(batch)]
        params = SamplingParams(max_response_length=response_len, temperature=1.0, seed=0)
        generate(model, prompts, SamplingParams(max_response_length=4, seed=0), use_kv_cache=use_kv_cache)  # warm-up
        times = []
        for _ in range(3):  # best of 3: the machine is shared with other jobs
            t0 = time.perf_counter()
            out = generate(model, prompts, params, use_kv_cache=use_kv_cache)
            times.append(time.perf_counter() - t0)
        return {"new_tokens": int(out.response_lengths.sum()), "s": min(times),
                "responses": out.responses}
    finally:
        parallel.destroy(destroy_process_group=False)


def bench_cpu(quick: bool) -> list[str]:
    arch = tiny_arch()
    seqs, seq_len, n_mb, iters = (4, 128, 2, 3) if quick else (8, 256, 4, 5)
    lines = ["### CPU: tiny actor fwd+bwd (2 layers, hidden 64, GQA 4/2, vocab 512; fp32, gloo)", "",
             f"{n_mb} packed micro-batches x {seqs} sequences x {seq_len} tokens per step, log-prob + entropy loss; "
             f"best (and median) of {iters} steps after 2 warm-up steps. One torch thread per rank (two OpenMP threads per rank stall for a "
             "scheduler quantum on a busy 2-core machine): TP1 = 1 rank on 1 core, TP2 = 2 ranks on 2 cores.", "",
             "| layout | tokens/step | step (s), best / median | tokens/s (best) |", "|---|---:|---:|---:|"]
    results = {}
    for tp, ranks, threads in ((1, 1, 1), (2, 2, 1)):
        with LocalWorkerPool(ranks, threads_per_rank=threads) as pool:
            r = pool.run(_fwd_bwd_job, tp, arch.to_dict(), seqs, seq_len, n_mb, iters, "float32")[0]
        results[tp] = r
        lines.append(f"| TP{tp} | {r['tokens']} | {r['best_s']:.3f} / {r['median_s']:.3f} | "
                     f"{r['tokens'] / r['best_s']:.0f} |")
    lines += ["", f"TP2 / TP1 throughput: {results[1]['best_s'] / results[2]['best_s']:.2f}x "
                  "(TP on a 2-core CPU adds gloo all-reduces per layer; it is there for correctness, not speed).", ""]

    gen_arch = ModelArch(**GEN_ARCH)
    batch, prompt_len, resp = (4, 32, 64) if quick else (8, 64, 128)
    lines += [f"### CPU: generation with vs without KV cache "
              f"({gen_arch.num_layers} layers, hidden {gen_arch.hidden_size}, vocab {gen_arch.vocab_size}, "
              f"{gen_arch.num_parameters() / 1e6:.1f} M params; fp32, 1 rank, 1 thread)", "",
              f"batch {batch}, prompts of {prompt_len} tokens, {resp} sampled tokens each (no eos).", "",
              "| mode | new tokens | time (s, best of 3) | tokens/s |", "|---|---:|---:|---:|"]
    gen = {}
    with LocalWorkerPool(1, threads_per_rank=1) as pool:
        for kv in (True, False):
            r = pool.run(_generation_job, gen_arch.to_dict(), batch, prompt_len, resp, kv)[0]
            gen[kv] = r
            lines.append(f"| {'KV cache' if kv else 'full recompute'} | {r['new_tokens']} | {r['s']:.2f} | "
                         f"{r['new_tokens'] / r['s']:.0f} |")
    same = torch.equal(gen[True]["responses"], gen[False]["responses"])
    # tokens pushed through the model per row: cache = prompt + response; recompute = sum of prefix lengths
    expected = sum(range(prompt_len, prompt_len + resp)) / (prompt_len + resp)
    kv_step_ms = gen[True]["s"] / resp * 1000
    lines += ["", f"KV-cache speed-up: {gen[False]['s'] / gen[True]['s']:.1f}x measured. The recompute path pushes "
                  f"{expected:.0f}x more tokens through the model (sum of prefix lengths / sequence length): that is "
                  f"the speed-up bound for a compute-bound model. A cached decode step ({kv_step_ms:.1f} ms for {batch} "
                  f"rows) multiplies [{batch} x hidden] activations, which run at a fraction of the FLOP rate of the "
                  f"recompute path's long prefixes, and pays per-step python/module overhead, so the measured factor "
                  f"is below the bound. Same sampled tokens in both modes: {same}.", ""]

    tiny_batch, tiny_prompt, tiny_resp = 8, 32, 64
    lines += [f"Tiny actor (overhead-bound) for reference, batch {tiny_batch}, prompt {tiny_prompt}, "
              f"{tiny_resp} new tokens:", "", "| mode | tokens/s |", "|---|---:|"]
    with LocalWorkerPool(1, threads_per_rank=1) as pool:
        for kv in (True, False):
            r = pool.run(_generation_job, arch.to_dict(), tiny_batch, tiny_prompt, tiny_resp, kv)[0]
            lines.append(f"| {'KV cache' if kv else 'full recompute'} | {r['new_tokens'] / r['s']:.0f} |")
    return lines


def bench_gpu(peak_tflops: float, quick: bool) -> list[str]:
    arch = ModelArch(**GPU_1B_ARCH)
    seqs, seq_len, n_mb, iters = (4, 1024, 2, 3) if quick else (8, 2048, 4, 5)
    with LocalWorkerPool(1) as pool:
        r = pool.run(_fwd_bwd_job, 1, arch.to_dict(), seqs, seq_len, n_mb, iters, "bfloat16")[0]
    from megatron_ppo.models.spec import resolve_transformer_impl

    tps = r["tokens"] / r["best_s"]
    flops = train_flops_per_token(arch, seq_len) * tps
    return [f"### GPU: ~{arch.num_parameters() / 1e9:.2f} B actor fwd+bwd, bf16, TP1 "
            f"({torch.cuda.get_device_name()}, {resolve_transformer_impl('auto')} spec)", "",
            "| tokens/step | step (s) | tokens/s | model TFLOP/s | MFU |", "|---:|---:|---:|---:|---:|",
            f"| {r['tokens']} | {r['best_s']:.3f} | {tps:.0f} | {flops / 1e12:.1f} | "
            f"{flops / 1e12 / peak_tflops:.1%} |", "",
            f"MFU against {peak_tflops:.0f} TFLOP/s bf16 dense peak.", ""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/models.md")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="GPU bf16 peak for MFU (H200 measured)")
    args = parser.parse_args(argv)
    env = f"MEGATRON_PPO_OPS={os.environ['MEGATRON_PPO_OPS']} " if os.environ.get("MEGATRON_PPO_OPS") else ""
    cmd = env + "python tools/bench_models.py" + (" --quick" if args.quick else "")
    lines = ["## Models (megatron-core GPTModel: actor fwd+bwd, generation)", "",
             f"Command: `{cmd}` — {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"load average at start {os.getloadavg()[0]:.1f} (other jobs share the machine: numbers are indicative).",
             ""]
    if torch.cuda.is_available():
        lines += bench_gpu(args.peak_tflops, args.quick)
    else:
        lines += bench_cpu(args.quick)
        lines += ["### GPU", "", "Pending: no GPU was lent to this run. On a CUDA machine this script measures a "
                  "~1.2 B Llama-style actor (bf16, TE or SDPA spec) and reports tokens/s and MFU.", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
