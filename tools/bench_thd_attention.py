"""Packed (THD) attention strategies of the local spec, side by side: actor forward + backward of one packed
micro-batch through the real model (``model_forward``: PackedSequences, per-token RoPE), per strategy.

    python tools/bench_thd_attention.py --out docs/bench/thd_attention.md                   # CPU: fp32
    python tools/bench_thd_attention.py --shape qwen2.5-0.5b --tokens 16384 --json thd.json  # GPU: bf16

The strategies (models/attention.py): per_sequence (one SDPA call per sequence), padded (one SDPA call on
[n, max_s] rows), block_mask (one call with a [t, t] mask), varlen (torch's flash varlen kernel, CUDA bf16/fp16
only). ``auto`` picks per_sequence on the CPU, varlen (else padded) on a GPU; this measurement is what decides it.
Sequence lengths are drawn like a PPO micro-batch's (prompt + response, uneven) until ``--tokens`` are packed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                 vocab_size=512, max_position_embeddings=4096),
    "smollm2-135m": dict(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                         num_query_groups=3, vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                         num_query_groups=2, vocab_size=151936, max_position_embeddings=32768, add_qkv_bias=True,
                         tie_word_embeddings=True),
}


def sequence_lengths(tokens: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Uneven lengths in [low, high] summing to exactly ``tokens`` (the last one trimmed)."""
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < tokens:
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        n = min(n, tokens - total)
        out.append(n)
        total += n
    return out


def set_strategy(model, strategy: str) -> None:
    from megatron_ppo.models.attention import SDPACoreAttention

    for m in model.modules():
        if isinstance(m, SDPACoreAttention):
            m.thd_strategy = strategy


def time_strategies(model, micro, strategies: list[str], iters: int, sync) -> dict[str, float]:
    """Median seconds of forward + backward per strategy, the strategies interleaved round by round (a machine
    whose load changes during the run charges them alike); round 0 is warm-up."""
    from megatron_ppo.models.forward import model_forward

    times: dict[str, list[float]] = {s: [] for s in strategies}
    for i in range(iters + 1):
        for strategy in strategies:
            set_strategy(model, strategy)
            sync()
            start = time.perf_counter()
            out = model_forward(model, micro)
            out.float().square().mean().backward()
            sync()
            if i:
                times[strategy].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {s: statistics.median(t) for s, t in times.items()}


def run(shape: str, tokens: int, low: int, high: int, iters: int, strategies: list[str]) -> dict:
    from megatron_ppo import parallel
    from megatron_ppo.models.arch import ModelArch
    from megatron_ppo.models.attention import _varlen_attn
    from megatron_ppo.models.forward import pack_sequences
    from megatron_ppo.models.gpt import build_gpt_model

    parallel.initialize(tp=1, pp=1, seed=1)
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    arch = ModelArch(**SHAPES[shape])
    model = build_gpt_model(arch, "actor", params_dtype=dtype, transformer_impl="local")
    lengths = sequence_lengths(tokens, low, high)
    g = torch.Generator().manual_seed(1)
    ids, cu = pack_sequences([torch.randint(0, arch.vocab_size, (n,), generator=g) for n in lengths])
    device = next(model.parameters()).device
    micro = {"input_ids": ids.to(device), "cu_seqlens": cu.to(device), "seq_bounds": tuple(cu.tolist())}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows, runnable = {}, []
    for strategy in strategies:
        if strategy == "varlen" and (not cuda or _varlen_attn is None):
            rows[strategy] = None
        elif strategy == "flex" and not cuda:
            rows[strategy] = None  # torch's FlexAttention has no backward on the CPU
        elif strategy == "block_mask" and tokens > 8192:
            rows[strategy] = None  # a [t, t] mask per head: not a candidate at this size
        else:
            runnable.append(strategy)
    for strategy, seconds in time_strategies(model, micro, runnable, iters, sync).items():
        rows[strategy] = {"ms": seconds * 1e3, "tokens_per_s": tokens / seconds}
    parallel.destroy()
    return {"shape": shape, "tokens": tokens, "sequences": len(lengths), "max_len": max(lengths),
            "dtype": str(dtype).replace("torch.", ""), "device": torch.cuda.get_device_name() if cuda else
            (platform.processor() or platform.machine()), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "strategies": rows}


def render(results: list[dict], command: str) -> str:
    lines = ["# Packed (THD) attention strategies of the local spec", "",
             "Actor forward + backward of one packed micro-batch through the real model (`model_forward`), median "
             "of the timed rounds after a warm-up round; the strategies interleaved round by round on the same "
             "micro-batch in one process.", "",
             f"Command: `{command}`", "",
             "| shape | device | dtype | tokens (sequences, longest) | strategy | ms | tokens/s | vs per_sequence |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = (r["strategies"].get("per_sequence") or {}).get("ms")
        for name, row in r["strategies"].items():
            if row is None:
                continue
            ratio = f"{base / row['ms']:.2f}x" if base else ""
            lines.append(f"| {r['shape']} | {r['device']} ({r['threads']} threads) | {r['dtype']} | {r['tokens']} "
                         f"({r['sequences']}, {r['max_len']}) | {name} | {row['ms']:.1f} | "
                         f"{row['tokens_per_s']:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=["tiny", "smollm2-135m"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--min-len", type=int, default=40)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--strategies", nargs="+", default=["per_sequence", "padded", "block_mask", "flex", "varlen"])
    ap.add_argument("--out")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    results = [run(s, args.tokens, args.min_len, args.max_len, args.iters, args.strategies) for s in args.shape]
    command = "python tools/bench_thd_attention.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(results, command.strip())
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
