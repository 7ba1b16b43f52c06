"""fp32 CPU GEMMs on oneDNN (``ops.cpu_matmul``, ``<role>.model.cpu_gemm=onednn``) vs torch's default (MKL): the
GEMMs alone at a model's shapes, then the paths the trainer takes (a worker's log-prob forward and one PPO update),
in one process, rounds interleaved (issue 16).

    .venv/bin/python tools/bench_cpu_matmul.py --rounds 3                      # SmolLM2-135M shape, 16 x ~220
    .venv/bin/python tools/bench_cpu_matmul.py --arch tiny --rows 8 --rounds 1   # a quick smoke run

GEMMs: forward ``x W^T``, input gradient ``dY W`` and weight gradient ``dY^T X`` of the model's linear shapes at
M = the packed tokens of ``--rows`` rows, median of 5 calls each, as megatron's linear layer calls them
(``torch.matmul``) with and without ``onednn_matmul``. Paths: ``MegatronWorker.forward`` (the log-prob pass of the
actor, reference and old-log-prob recompute) and ``MegatronWorker.train_step`` (forward + backward + Adam) on one
micro-batch, random-init weights, lr 0 (every round sees the same weights), both workers built from the same seed;
the log-prob and gradient-norm differences between the two show the rounding-level effect.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import torch
from bench_response_logits import ARCHS, ZERO_LR_OPTIM, actor_fns, make_batch, worker_bench_args


def _median_s(fn, calls: int = 5) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_table(arch: dict, tokens: int) -> list[dict]:
    from megatron_ppo.ops.cpu_matmul import onednn_matmul

    h, f, v = arch["hidden_size"], arch["ffn_hidden_size"], arch["vocab_size"]
    kv = h // arch["num_attention_heads"] * arch["num_query_groups"]
    shapes = {"qkv": (h + 2 * kv, h), "attn out": (h, h), "fc1 (gate+up)": (2 * f, h), "fc2": (h, f),
              "lm head": (v, h)}
    rows = []
    for name, (n, k) in shapes.items():
        x, w, dy = torch.randn(tokens, k), torch.randn(n, k), torch.randn(tokens, n)
        flop = 2 * tokens * n * k
        for kind, fn in (("forward x W^T", lambda: torch.matmul(x, w.t())),
                         ("input grad dY W", lambda: dy.matmul(w)),
                         ("weight grad dY^T X", lambda: dy.t().matmul(x))):
            t_mkl = _median_s(fn)
            with onednn_matmul():
                t_dnn = _median_s(fn)
            rows.append({"gemm": f"{name} {kind}", "m_n_k": (tokens, n, k), "mkl_gflops": flop / t_mkl / 1e9,
                         "onednn_gflops": flop / t_dnn / 1e9})
            print(f"{name:14s} {kind:20s} M={tokens} N={n} K={k}: MKL {rows[-1]['mkl_gflops']:5.0f}  oneDNN "
                  f"{rows[-1]['onednn_gflops']:5.0f} GFLOPS", flush=True)
    return rows


def main() -> None:
    args = worker_bench_args(__doc__.splitlines()[0])

    from megatron_ppo import parallel
    from megatron_ppo.data.batch import pack_rows
    from megatron_ppo.models.arch import ModelArch
    from megatron_ppo.ops.cpu_matmul import onednn_available
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    if not onednn_available():
        raise SystemExit("this torch build has no oneDNN linear op: nothing to compare")
    parallel.initialize(tp=1, pp=1, seed=1)
    arch = ModelArch(**ARCHS[args.arch])
    batch = make_batch(args.rows, args.prompt, args.response, arch.vocab_size)
    micro = pack_rows(batch, list(range(batch.size)), ("old_log_probs", "advantages", "ref_log_probs"))
    tokens = micro["input_ids"].numel()
    print(f"{args.arch}: {args.rows} rows, T = {tokens} packed tokens; {args.threads} threads\n", flush=True)
    gemms = gemm_table(ARCHS[args.arch], tokens)

    workers = {}
    for gemm in ("torch", "onednn"):
        parallel.seed_everything(1)  # both start from the same weights
        workers[gemm] = MegatronWorker("actor", arch, optim=ZERO_LR_OPTIM, cpu_gemm=gemm)
    loss_fn, output_fn = actor_fns(arch, batch)
    small = pack_rows(batch, [0, 1], ("old_log_probs", "advantages", "ref_log_probs"))
    for worker in workers.values():  # warm-up: Adam's state, oneDNN's primitive cache
        worker.forward([small], output_fn)
        worker.train_step([small], loss_fn)

    results = {gemm: [] for gemm in workers}
    for r in range(args.rounds):
        logps, norms = {}, {}
        for gemm in (("torch", "onednn") if r % 2 == 0 else ("onednn", "torch")):
            worker = workers[gemm]
            start, cpu = time.perf_counter(), time.process_time()
            logps[gemm] = worker.forward([micro], output_fn)[0]["log_probs"]
            fwd_s, fwd_cpu = time.perf_counter() - start, time.process_time() - cpu
            start, cpu = time.perf_counter(), time.process_time()
            step = worker.train_step([micro], loss_fn)
            upd_s, upd_cpu = time.perf_counter() - start, time.process_time() - cpu
            norms[gemm] = step["grad_norm"]
            results[gemm].append({"round": r, "log_probs_s": fwd_s, "log_probs_cpu_s": fwd_cpu, "update_s": upd_s,
                                  "update_cpu_s": upd_cpu, "grad_norm": step["grad_norm"]})
            print(f"round {r} {gemm:6s}: log-probs {fwd_s:6.2f} s ({fwd_cpu:6.2f} CPU-s)  update {upd_s:6.2f} s "
                  f"({upd_cpu:6.2f} CPU-s)  grad_norm {step['grad_norm']:.7g}", flush=True)
        diff = (logps["torch"] - logps["onednn"]).abs().max().item()
        print(f"round {r}: max |log-prob difference| = {diff:.2e}, grad-norm relative difference = "
              f"{abs(norms['torch'] - norms['onednn']) / norms['torch']:.2e}", flush=True)

    print(f"\nGEMMs (M = {tokens} packed tokens, {args.threads} threads), GFLOPS, median of 5 calls:\n")
    print("| GEMM | M x N x K | MKL (torch) | oneDNN | oneDNN / MKL |")
    print("| --- | --- | ---: | ---: | ---: |")
    for g in gemms:
        print(f"| {g['gemm']} | {' x '.join(map(str, g['m_n_k']))} | {g['mkl_gflops']:.0f} | "
              f"{g['onednn_gflops']:.0f} | {g['onednn_gflops'] / g['mkl_gflops']:.2f} |")
    print(f"\nWorker paths, medians over {args.rounds} interleaved rounds ({args.arch}, {args.rows} rows, T = {tokens}; "
          f"load average {os.getloadavg()[0]:.1f}):\n")
    print("| cpu_gemm | log-prob forward wall (s) | CPU (s) | update wall (s) | CPU (s) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    med = {gemm: {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "round"}
           for gemm, rows in results.items()}
    for gemm, m in med.items():
        print(f"| {gemm} | {m['log_probs_s']:.2f} | {m['log_probs_cpu_s']:.2f} | {m['update_s']:.2f} | "
              f"{m['update_cpu_s']:.2f} |")
    print(f"| onednn / torch | {med['onednn']['log_probs_s'] / med['torch']['log_probs_s']:.2f} | | "
          f"{med['onednn']['update_s'] / med['torch']['update_s']:.2f} | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "gemms": gemms, **results}, f, indent=1)
    parallel.destroy()


if __name__ == "__main__":
    main()
