"""TRL PPOTrainer steps on the peer benchmark's case; run by tools/bench_peer.py inside build/peer-venv (TRL needs a
newer transformers than this project pins), never imported by the project.

    build/peer-venv/bin/python tools/peer_trl_ppo.py --hf-dir DIR --prompts P.jsonl --steps 3 --response-length 64
                                                   --threads 2 --out result.json

Policy, reference, value and reward models are the same HF checkpoint (value/reward: a fresh 1-output score head),
fp32 on CPU, one PPO epoch, one mini-batch = the whole batch, no gradient checkpointing (TRL's default would also
switch generation's KV cache off). Phases are timed by wrapping TRL's module-level
``batch_generation`` (generation), ``forward`` without grad and ``get_reward`` (forward-only passes: reference,
value, reward); the update is the rest of the step. Step times come from ``on_step_end``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl of {'prompt': [chat messages]} (the batch, in order)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=None, help="rows per forward/backward (gradient "
                    "accumulation over the batch) and per rollout forward; default: the whole batch")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as T

    tok = AutoTokenizer.from_pretrained(args.hf_dir, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [json.loads(line) for line in open(args.prompts)]
    ids = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
           for r in rows]
    n = len(ids)
    data = Dataset.from_dict({"input_ids": ids})

    def load(cls, **kw):
        return cls.from_pretrained(args.hf_dir, dtype=torch.float32, **kw)

    policy, ref = load(AutoModelForCausalLM), load(AutoModelForCausalLM)
    value = load(AutoModelForSequenceClassification, num_labels=1)
    reward = load(AutoModelForSequenceClassification, num_labels=1)
    for m in (value, reward):
        m.config.pad_token_id = tok.pad_token_id

    phases = {"gen": 0.0, "forward_only": 0.0}

    def timed(name, fn, only_no_grad=False):
        def wrapper(*a, **k):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - t0
        return wrapper

    T.batch_generation = timed("gen", T.batch_generation)
    T.forward = timed("forward_only", T.forward, only_no_grad=True)
    T.get_reward = timed("forward_only", T.get_reward)

    steps = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):  # not called by PPOTrainer; the end of the previous step is the start
            pass

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            steps.append({"end": now, **phases})
            for key in phases:
                phases[key] = 0.0

    out_dir = tempfile.mkdtemp(prefix="trl-ppo-")
    micro = args.micro_batch or n
    if n % micro:
        raise SystemExit(f"--micro-batch {micro} does not divide the {n} prompts")
    # one optimizer step per PPO step over all n rows (local batch = micro x accumulation x 1 mini-batch)
    cfg = PPOConfig(output_dir=out_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=n // micro,
                    num_mini_batches=1, num_ppo_epochs=1, response_length=args.response_length,
                    total_episodes=n * args.steps, local_rollout_forward_batch_size=micro, temperature=1.0,
                    stop_token="eos", missing_eos_penalty=None, num_sample_generations=0, use_cpu=True,
                    report_to=[], save_strategy="no", logging_steps=1, learning_rate=1e-6, seed=1,
                    dataloader_num_workers=0, bf16=False, fp16=False,
                    # TRL's default (True) turns the KV cache off in generation (every token recomputes the whole
                    # sequence); megatron_ppo recomputes no activations either, so both run without it.
                    gradient_checkpointing=False)
    trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=data, callbacks=[StepTimes()])
    start = time.perf_counter()
    trainer.train()
    prev = start
    records = []
    for s in steps:
        records.append({"step_s": s["end"] - prev, "gen_s": s["gen"], "forward_only_s": s["forward_only"],
                        "update_s": s["end"] - prev - s["gen"] - s["forward_only"]})
        prev = s["end"]
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(args.out, "w") as f:
        json.dump({"steps": records, "peak_rss_gb": peak_kb / 1e6, "prompts": n,
                   "torch": torch.__version__, "threads": torch.get_num_threads()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
