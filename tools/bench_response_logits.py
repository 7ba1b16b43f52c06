"""The LM head only at response positions (``logit_positions``) vs every packed position: time and peak memory of
one actor ``compute_log_probs`` forward and one PPO update, in one process, rounds interleaved (issue 16).

    .venv/bin/python tools/bench_response_logits.py --rounds 3                    # SmolLM2-135M shape, 16 x ~220
    .venv/bin/python tools/bench_response_logits.py --arch tiny --rows 8 --rounds 2   # a quick smoke run

One micro-batch of ``--rows`` packed sequences (prompt ``--prompt`` tokens, response ``--response`` tokens, +-10 %),
random-init weights, fp32, TP = PP = DP = 1, lr 0 (every round sees the same weights), after a two-row warm-up
of both paths. "full" is the same micro-batch without ``logit_positions`` (the model
then computes logits at all T positions). Peak memory: the process's resident set sampled every millisecond during
the phase, minus its size when the phase started (large tensors are mmap'd and return to the OS when freed).
CPU seconds (this process, all threads) are reported beside wall time: on a shared machine they vary less.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import threading
import time
from types import SimpleNamespace

import torch

ARCHS = {  # SmolLM2-135M's shape (as tools/bench_ppo.py), and the tests' tiny model
    "smollm2-135m": dict(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                         num_query_groups=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True),
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True),
}


class PeakRSS:
    """Peak resident-set growth (MiB) over a ``with`` block, sampled by a thread."""

    def __init__(self, interval: float = 1e-3):
        self.interval, self.page = interval, os.sysconf("SC_PAGE_SIZE")
        self._libc = ctypes.CDLL("libc.so.6") if platform.system() == "Linux" else None

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        if self._libc is not None:
            self._libc.malloc_trim(0)  # hand back what the last phase freed, so its peak does not hide this one's
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.mib = (self.peak - self.start) / 2 ** 20


def make_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    from megatron_ppo.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)

    def lengths(mean):
        return (mean * (0.9 + 0.2 * torch.rand(rows, generator=g))).round().long().clamp(min=1).tolist()

    prompt_lens, resp_lens = lengths(prompt), lengths(response)
    width = max(resp_lens)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in prompt_lens]
    mask = (torch.arange(width) < torch.tensor(resp_lens)[:, None]).float()
    responses = torch.randint(0, vocab, (rows, width), generator=g) * mask.long()
    tensors = {"old_log_probs": -2 + 0.3 * torch.randn(rows, width, generator=g),
               "ref_log_probs": -2 + 0.3 * torch.randn(rows, width, generator=g),
               "advantages": torch.randn(rows, width, generator=g)}
    return RolloutBatch(prompts, responses, mask, tensors)


# Adam with lr 0: every round of a benchmark sees the same weights
ZERO_LR_OPTIM = SimpleNamespace(lr=0.0, weight_decay=0.0, betas=[0.9, 0.999], clip_grad=1.0, lr_warmup_steps=0,
                                lr_warmup_steps_ratio=0.0, lr_warmup_init=0.0, lr_decay_steps=None,
                                lr_decay_style="constant", min_lr=0.0)


def worker_bench_args(description: str):
    """The command line shared by the one-micro-batch worker benchmarks (this one, bench_cpu_matmul.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=143, help="mean prompt tokens (GSM8K-like: ~65 %% of a row)")
    ap.add_argument("--response", type=int, default=77, help="mean response tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", default=None, help="also write the raw measurements here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def actor_fns(arch, batch):
    """(loss_fn, output_fn): the PPO actor loss (entropy and KL loss on) over ``batch`` as one mini-batch, and the
    log-prob pass's output function."""
    from megatron_ppo.config import load_config
    from megatron_ppo.workers.losses import actor_loss_fn, logprob_output_fn

    actor_cfg = load_config("tiny_cpu", ["actor.entropy_coeff=0.01", "actor.use_kl_loss=true"]).actor
    loss_fn = actor_loss_fn(actor_cfg, vocab_size=arch.vocab_size, temperature=1.0,
                            mini_batch_tokens=int(batch.loss_mask.sum()), mini_batch_seqs=batch.size)
    return loss_fn, logprob_output_fn(arch.vocab_size, 1.0)


def main() -> None:
    args = worker_bench_args(__doc__.splitlines()[0])

    from megatron_ppo import parallel
    from megatron_ppo.data.batch import pack_rows
    from megatron_ppo.models.arch import ModelArch
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    parallel.initialize(tp=1, pp=1, seed=1)
    arch = ModelArch(**ARCHS[args.arch])
    worker = MegatronWorker("actor", arch, optim=ZERO_LR_OPTIM)  # lr 0: both paths see the same weights every round
    batch = make_batch(args.rows, args.prompt, args.response, arch.vocab_size)
    micro = pack_rows(batch, list(range(batch.size)), ("old_log_probs", "advantages", "ref_log_probs"))
    full = {k: v for k, v in micro.items() if k not in ("logit_positions", "logit_index")}
    tokens, selected = micro["input_ids"].numel(), micro["logit_positions"].numel()
    loss_fn, output_fn = actor_fns(arch, batch)
    print(f"{args.arch}: {sum(p.numel() for p in worker.model.parameters()) / 1e6:.1f} M parameters; {args.rows} rows, "
          f"T = {tokens} packed tokens, {selected} logit positions ({selected / tokens:.0%})", flush=True)

    # warm-up on two rows, both paths: the first update allocates Adam's state, which neither path should pay
    small = pack_rows(batch, [0, 1], ("old_log_probs", "advantages", "ref_log_probs"))
    for mb in (small, {k: v for k, v in small.items() if k not in ("logit_positions", "logit_index")}):
        worker.forward([mb], output_fn)
        worker.train_step([mb], loss_fn)
    results = {"full": [], "response": []}
    logps = {}
    for r in range(args.rounds):
        for path in (("full", "response") if r % 2 == 0 else ("response", "full")):
            mb = micro if path == "response" else full
            with PeakRSS() as fwd_mem:
                start, cpu = time.perf_counter(), time.process_time()
                out = worker.forward([mb], output_fn)[0]
                fwd_s, fwd_cpu = time.perf_counter() - start, time.process_time() - cpu
            logps[path] = out["log_probs"]
            with PeakRSS() as upd_mem:
                start, cpu = time.perf_counter(), time.process_time()
                step = worker.train_step([mb], loss_fn)
                upd_s, upd_cpu = time.perf_counter() - start, time.process_time() - cpu
            row = {"round": r, "log_probs_s": fwd_s, "log_probs_cpu_s": fwd_cpu, "log_probs_peak_mib": fwd_mem.mib,
                   "update_s": upd_s, "update_cpu_s": upd_cpu, "update_peak_mib": upd_mem.mib, "loss": step["loss"],
                   "grad_norm": step["grad_norm"]}
            results[path].append(row)
            print(f"round {r} {path:8s}: log-probs {fwd_s:6.2f} s, {fwd_cpu:6.2f} CPU-s (+{fwd_mem.mib:6.0f} MiB)  "
                  f"update {upd_s:6.2f} s, {upd_cpu:6.2f} CPU-s (+{upd_mem.mib:6.0f} MiB)  "
                  f"grad_norm {step['grad_norm']:.6g}", flush=True)
        diff = (logps["full"] - logps["response"]).abs().max().item()
        print(f"round {r}: max |log-prob difference| (full vs response) = {diff:.2e}", flush=True)

    print(f"\nmedians over {args.rounds} rounds ({args.arch}, {args.rows} x ~{args.prompt + args.response} tokens, "
          f"T = {tokens}, {selected} logit positions; {args.threads} threads; load average "
          f"{os.getloadavg()[0]:.1f}):\n")
    print("| path | log-probs wall (s) | CPU (s) | peak (MiB) | update wall (s) | CPU (s) | peak (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path, rows in results.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "round"}
        print(f"| {path} | {med['log_probs_s']:.2f} | {med['log_probs_cpu_s']:.2f} | {med['log_probs_peak_mib']:.0f} | "
              f"{med['update_s']:.2f} | {med['update_cpu_s']:.2f} | {med['update_peak_mib']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tokens": tokens, "logit_positions": selected, **results}, f, indent=1)
    parallel.destroy()


if __name__ == "__main__":
    main()
