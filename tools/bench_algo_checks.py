#!/usr/bin/env python
"""What the input validation of the per-step algo/ops entry points costs next to the math it guards.

For each entry point the trainer calls every step, at trainer-size inputs ([B, R] = [256, 512] float32, the float32
0/1 ``response_mask`` the trainer passes), three timings interleaved in one run (median of --reps):
  public      the public function: metadata checks + value checks (0/1 mask, NaN/inf) + math;
  checks off  the same with value checks off (``MEGATRON_PPO_ALGO_VALUE_CHECKS=0``): metadata checks + math;
  math        the underscored math alone on a ready bool mask.
validation = public - math, reported as a multiple of math (a defect when > 1: the check costs more than the
work it guards), for a mask not validated yet and for the same mask again (checks.mask remembers a validated
mask tensor until it is written to). Prints a markdown section; --out writes it (docs/bench/algo_checks.md).

Usage: python tools/bench_algo_checks.py [--batch 256] [--length 512] [--reps 30] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import fmt_ms, header, interleaved_times, ops_mode, value_checks  # noqa: E402

from megatron_ppo import ops  # noqa: E402
from megatron_ppo.algo import advantages as A  # noqa: E402
from megatron_ppo.algo import losses as L  # noqa: E402
from megatron_ppo.algo import rollout_correction as RC  # noqa: E402


def cases(batch: int, length: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask_b = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    mask_f = mask_b.float()
    x = torch.randn(batch, length, generator=gen)
    log_ratio = 0.05 * torch.randn(batch, length, generator=gen)
    n_rows = max(1, (64 << 20) // (2 * vocab))  # one 64 MiB bf16 logits micro-batch
    logits = torch.randn(n_rows, vocab, generator=gen).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n_rows,), generator=gen)

    def logprob():
        with ops_mode("auto"), torch.no_grad():
            return ops.token_logprobs_entropy(logits, target)

    # public(mask): the mask is an argument so that a fresh copy (not yet validated) can be passed
    return mask_f, {
        "`masked_whiten`": (lambda m: A.masked_whiten(x, m), lambda: A.masked_whiten_unchecked(x, mask_b)),
        "`agg_loss` (token-mean)": (lambda m: L.agg_loss(x, m, "token-mean"),
                                    lambda: L._agg_loss(x, mask_b, "token-mean", 1, None, None, None)),
        "`compute_rollout_correction_weights` (token TIS)": (
            lambda m: RC.compute_rollout_correction_weights(log_ratio, m),
            lambda: RC._to_floats(RC._rollout_correction_weights(log_ratio, mask_b, "token", 2.0, False)[1])),
        "`compute_rollout_rejection_mask` (token_k1)": (
            lambda m: RC.compute_rollout_rejection_mask(log_ratio, m, "token_k1", "0.5_2.0"),
            lambda: RC._to_floats(RC._rejection_mask(log_ratio, mask_b, "token_k1", "0.5_2.0")[1])),
        f"`ops.token_logprobs_entropy` (N={n_rows}, V={vocab}, bf16; kernel)": (lambda m: logprob(), None),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    cpu = torch.device("cpu")
    lines = [l.replace("bench_kernels.py", "bench_algo_checks.py") for l in header(argv)]
    lines += [f"### Validation vs math, [B, R] = [{args.batch}, {args.length}] float32, float32 0/1 mask "
              f"(CPU, {torch.get_num_threads()} threads)", "",
              "public (new mask) = a mask tensor this process has not validated yet (the first call of a step); "
              "public (same mask) = a later call with the same mask tensor in the same step (checked once per "
              "batch: not re-read).", "",
              "| entry point | public, new mask (ms) | public, same mask (ms) | value checks off (ms) | "
              "math alone (ms) | validation / math: new / same mask |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    mask, entries = cases(args.batch, args.length, args.vocab)
    for name, (public, math) in entries.items():
        def unchecked(m, fn=public):
            with value_checks(False):
                return fn(m)
        methods = {"new": lambda m, fn=public: fn(m), "same": lambda _, fn=public: fn(mask), "off": unchecked}
        if math is not None:
            methods["math"] = lambda _, fn=math: fn()
        t = interleaved_times(methods, cpu, args.reps, warmup=2, setup=lambda: (mask.clone(),))
        base = t.get("math", t["off"])  # the log-prob op: math = the call with value checks off
        lines.append(f"| {name} | {fmt_ms(t['new'])} | {fmt_ms(t['same'])} | {fmt_ms(t['off'])} | "
                     f"{fmt_ms(t['math']) if 'math' in t else '(= checks off)'} | "
                     f"{(t['new'] - base) / base:.2f}x / {(t['same'] - base) / base:.2f}x |")
    text = "\n".join(lines + [""])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
