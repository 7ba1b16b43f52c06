"""A bf16 PPO step on a ~0.5 B model through the real driver and role workers, in one process (tools/gpu_check.sh,
stage ppo_step): ``cluster.launcher=local`` (actor, critic and ref each an in-process rank, no Ray),
``cluster.device=cuda``, random weights of a Qwen2.5-0.5B-shaped ``arch:`` (nothing is downloaded), the generated
arithmetic prompts and a word-level tokenizer of the model's full vocabulary built on the spot.

    python -m megatron_ppo.testing.gpu_step --out ppo_step.json [--steps 3 --batch 64 --response-length 256]
    python -m megatron_ppo.testing.gpu_step --dry-run        # config, parameter count, FLOP arithmetic; no model

MFU, as the gpu_check brief defines it: ``6 * params * tokens / step_time / peak`` with params the actor's
parameters (tied embedding counted once: megatron_ppo.plan.memory.total_params), tokens every prompt + response
token of the step's rollout batch, and the peak the H200's dense bf16 datasheet rate (989 TFLOP/s; a real GEMM
reaches less, so MFU reads against the datasheet; results: docs/bench/gpu.md). That number charges the whole step
(generation included) against one training pass of the actor, so it is reported beside the actor update's own MFU
and an all-passes count (``step_model_flops``: every forward and backward of every role in the step). Attention
score FLOPs are left out of all three (about 3 % at these lengths).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.perf import H200_BF16_PEAK_FLOPS, mfu, step_model_flops  # noqa: F401 (one formula: perf.py)

log = logging.getLogger(__name__)

# Qwen2.5-0.5B's shape (HF config.json): 24 layers, hidden 896, GQA 14/2, SwiGLU 4864, QKV bias, tied embeddings.
QWEN2_0P5B = dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2,
                  vocab_size=151936, max_position_embeddings=4096, rotary_base=1000000.0, norm_epsilon=1e-6,
                  add_qkv_bias=True, tie_word_embeddings=True)
QWEN2_0P5B_PARAMS = 494_032_768  # the published parameter count of Qwen2.5-0.5B (tied embedding once)
# Qwen2.5-1.5B's shape (HF config.json): 28 layers, hidden 1536, GQA 12/2, SwiGLU 8960, QKV bias, tied embeddings.
QWEN2_1P5B = dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2,
                  vocab_size=151936, max_position_embeddings=4096, rotary_base=1000000.0, norm_epsilon=1e-6,
                  add_qkv_bias=True, tie_word_embeddings=True)
# A small stand-in with the same vocabulary, for the CPU rehearsal of this module (tests, --arch tiny).
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
            vocab_size=151936, max_position_embeddings=1024, tie_word_embeddings=True)
ARCHES = {"qwen2-0.5b": QWEN2_0P5B, "qwen2-1.5b": QWEN2_1P5B, "tiny": TINY}
MICRO_TOKENS = 16384  # the actor update's token budget per micro-batch (issue 47's MFU goal is stated at 16k)


def arch(name: str = "qwen2-0.5b") -> ModelArch:
    return ModelArch(**ARCHES[name])


def params(model_arch: ModelArch, role: str = "actor") -> int:
    """The role's parameter count as the planner counts it (plan.memory.total_params)."""
    from megatron_ppo.plan.memory import total_params

    return total_params(model_arch, role)


# ---------------------------------------------------------------------------------------------- inputs

def make_tokenizer(out_dir: str | Path, vocab_size: int, texts: list[str] = ()) -> Path:
    """An HF tokenizer directory of exactly ``vocab_size`` entries: the three chat specials, the words and
    punctuation of ``texts`` (so the prompts tokenise into real ids), then filler words ``w<i>``. Word-level, so
    every id the model can sample decodes."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from megatron_ppo.data.tokenizer import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

    split = pre_tokenizers.Whitespace()
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for text in list(texts) + ["0 1 2 3 4 5 6 7 8 9 #### + - * = ? . , : user assistant system"]:
        for piece, _ in split.pre_tokenize_str(text):
            if piece not in vocab and len(vocab) < vocab_size:
                vocab[piece] = len(vocab)
    filler = 0
    while len(vocab) < vocab_size:
        if f"w{filler}" not in vocab:
            vocab[f"w{filler}"] = len(vocab)
        filler += 1
    tok = Tokenizer(WordLevel(vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = split
    tok.add_special_tokens(SPECIAL_TOKENS)  # already in the vocabulary: matched whole, before the split
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                 unk_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
                                 model_max_length=1 << 20)
    out = Path(out_dir)
    hf.save_pretrained(str(out))
    if len(hf) != vocab_size:
        raise AssertionError(f"make_tokenizer: {len(hf)} entries, expected {vocab_size}")
    return out


def prepare_inputs(workdir: str | Path, vocab_size: int, seed: int = 0) -> tuple[Path, Path]:
    """(data dir with train.parquet, tokenizer dir) under ``workdir``: the generated arithmetic prompts."""
    import pyarrow.parquet as pq

    from megatron_ppo.data.preprocess import preprocess_arithmetic

    workdir = Path(workdir)
    data = workdir / "data"
    if not (data / "train.parquet").is_file():
        preprocess_arithmetic(data, train_rows=512, test_rows=8, seed=seed)
    texts = [m["content"] for row in pq.read_table(data / "train.parquet").column("prompt").to_pylist() for m in row]
    tokenizer = workdir / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        make_tokenizer(tokenizer, vocab_size, texts)
    return data, tokenizer


# ---------------------------------------------------------------------------------------------- config

def overrides(workdir: str | Path, *, arch_name: str = "qwen2-0.5b", device: str = "cuda", steps: int = 3,
              batch: int = 64, response_length: int = 256, micro_batch: int = 16, dtype: str = "bfloat16",
              engine: str = "megatron", micro_tokens: int = 0) -> list[str]:
    """Dotted overrides of configs/tiny_cpu.yaml: the arch, bf16 for every role, one in-process rank per role, the
    rollout engine (vllm: the vLLM of this interpreter, as a GPU image has it). ``micro_tokens`` > 0: every role's
    micro-batches by that token budget (use_dynamic_bsz) instead of ``micro_batch`` sequences."""
    wd = Path(workdir)
    values = {
        "data.preprocess.output_dir": wd / "data", "data.preprocess.build_tokenizer": "false",
        "data.train_files": f"[{wd / 'data' / 'train.parquet'}]", "data.val_files": "[]",
        "data.max_prompt_length": 128, "data.max_response_length": response_length, "data.train_batch_size": batch,
        "actor.model.tokenizer_path": wd / "tokenizer",
        **{f"actor.model.arch.{k}": v for k, v in ARCHES[arch_name].items()},
        "actor.model.dtype": dtype, "critic.model.dtype": dtype, "ref.model.dtype": dtype,
        "actor.optim.lr": 1e-6, "critic.optim.lr": 1e-5,
        "actor.ppo_epochs": 1, "critic.ppo_epochs": 1,
        "actor.ppo_mini_batch_size": batch, "actor.ppo_micro_batch_size_per_gpu": micro_batch,
        "critic.ppo_mini_batch_size": batch, "critic.ppo_micro_batch_size_per_gpu": micro_batch,
        "ref.log_prob_micro_batch_size_per_gpu": micro_batch, "rollout.log_prob_micro_batch_size_per_gpu": micro_batch,
        "trainer.total_training_steps": steps, "trainer.val_before_train": "false", "trainer.test_freq": -1,
        "trainer.save_freq": -1, "trainer.resume_mode": "disable", "trainer.logger": "[jsonl]",
        "trainer.log_dir": wd / "logs", "trainer.default_local_dir": wd / "checkpoints",
        "trainer.experiment_name": "gpu_check_ppo_step",
        "cluster.launcher": "local", "cluster.device": device, "cluster.n_gpus_per_node": 1,
        "cluster.actor.tensor_model_parallel_size": 1, "cluster.ref.tensor_model_parallel_size": 1,
        "rollout.name": engine,
    }
    if engine == "vllm":
        values.update({"rollout.vllm.python": sys.executable, "rollout.vllm.weights_dir": wd / "vllm_weights"})
    if micro_tokens > 0:
        for role in ("actor", "critic"):
            values.update({f"{role}.use_dynamic_bsz": "true", f"{role}.ppo_max_token_len_per_gpu": micro_tokens})
        for prefix in ("ref", "rollout"):
            values.update({f"{prefix}.log_prob_use_dynamic_bsz": "true",
                           f"{prefix}.log_prob_max_token_len_per_gpu": micro_tokens})
    return [f"{k}={v}" for k, v in values.items()]


def build_config(workdir: str | Path, **kwargs):
    from megatron_ppo.config import load_config

    return load_config("tiny_cpu", overrides(workdir, **kwargs))


# ---------------------------------------------------------------------------------------------- the run

def summarize(history: list[dict], actor_params: int, critic_params: int, cfg, peak: float) -> dict:
    """Per-step timings and the medians over the steps after the first (warm-up: allocator, kernels' first
    launch), with tokens/s and the three MFU figures."""
    timed = history[1:] if len(history) > 1 else history

    def med(key):
        vals = [h[key] for h in timed if key in h]
        return statistics.median(vals) if vals else float("nan")

    step_s, tokens = med("timing/step"), med("perf/total_num_tokens")
    resp_tokens = med("response_length/mean") * cfg.data.train_batch_size * cfg.rollout.n
    flops = step_model_flops(actor_params, critic_params, tokens, resp_tokens, cfg.actor.ppo_epochs,
                             cfg.critic.ppo_epochs, reference="ref" in cfg.roles)
    out = {
        "steps_measured": len(timed), "warmup_steps_excluded": len(history) - len(timed),
        "step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
        "response_tokens_per_step": resp_tokens,
        "gen_tokens_per_s": resp_tokens / med("timing/gen"),  # generated tokens over the rollout phase's seconds
        "timing_s": {k.split("/", 1)[1]: med(k) for k in sorted(history[-1]) if k.startswith("timing/")},
        "peak_flops": peak,
        "mfu_6nt_step": mfu(actor_params, tokens, step_s, peak),
        "mfu_actor_update": mfu(actor_params, tokens * cfg.actor.ppo_epochs, med("timing/update_actor"), peak),
        "mfu_all_passes_step": flops["step"] / step_s / peak,
        "model_flops_per_step": flops,
    }
    return out


def run(workdir: str | Path, *, arch_name: str = "qwen2-0.5b", device: str = "cuda", steps: int = 3,
        batch: int = 64, response_length: int = 256, micro_batch: int = 16, peak: float = H200_BF16_PEAK_FLOPS,
        dtype: str = "bfloat16", engine: str = "megatron", micro_tokens: int = 0) -> dict:
    """Build the components from the config and run ``steps`` PPO steps through PPOTrainer.fit; returns the
    results (see summarize) with the per-step metrics, and from the measured steps the host reads per micro-batch
    and each role's peak GPU memory in its own calls (testing/host_reads.WorkerCalls)."""
    import torch

    from megatron_ppo import ops
    from megatron_ppo.models.spec import resolve_transformer_impl
    from megatron_ppo.testing.host_reads import WorkerCalls
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.preflight import check_device
    from megatron_ppo.trainer.ppo import PPOTrainer

    model_arch = arch(arch_name)
    t0 = time.perf_counter()
    prepare_inputs(workdir, model_arch.vocab_size)
    cfg = build_config(workdir, arch_name=arch_name, device=device, steps=steps, batch=batch,
                       response_length=response_length, micro_batch=micro_batch, dtype=dtype, engine=engine,
                       micro_tokens=micro_tokens)
    check_device(cfg, torch.cuda.is_available())
    t_inputs = time.perf_counter() - t0
    parts = build_components(cfg)
    t_build = time.perf_counter() - t0 - t_inputs
    calls = WorkerCalls()
    try:
        trainer = PPOTrainer(cfg, parts)
        with calls:
            history = trainer.fit(1)  # warm-up (excluded from the medians too)
            calls.reset()
            history += trainer.fit(steps)
    finally:
        parts.close()
    actor_n, critic_n = params(model_arch, "actor"), params(model_arch, "critic")
    on_cuda = device == "cuda" and torch.cuda.is_available()
    torch_dtype = getattr(torch, dtype)
    keep = ("timing/", "perf/", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "critic/vf_loss",
            "critic/grad_norm", "reward/score/mean", "response_length/mean")
    result = {
        "arch": arch_name, "arch_fields": model_arch.to_dict(), "actor_params": actor_n, "critic_params": critic_n,
        "params_match_published": arch_name != "qwen2-0.5b" or actor_n == QWEN2_0P5B_PARAMS,
        "dtype": dtype, "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "transformer_impl": resolve_transformer_impl("auto", torch_dtype),
        "ops_backend": ops.backend("cuda" if on_cuda else "cpu"),
        "torch": torch.__version__, "engine": engine, "batch": batch, "response_length": response_length,
        "micro_batch": micro_batch, "micro_tokens": micro_tokens, "worker_calls": calls.totals(),
        "host_reads_by_call": dict(calls.counter.by_name),
        "steps": steps, "inputs_s": t_inputs, "build_s": t_build,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
        "history": [{k: v for k, v in h.items() if k.startswith(keep)} for h in history],
    }
    result.update(summarize(history, actor_n, critic_n, cfg, peak))
    return result


def describe(result: dict) -> str:
    t = result["timing_s"]
    return (f"ppo_step: {result['arch']} ({result['actor_params'] / 1e6:.1f} M params, {result['dtype']}, "
            f"{result['transformer_impl']} spec, ops {result['ops_backend']}) on {result['device']}: "
            f"step {result['step_s']:.2f} s (median of {result['steps_measured']}; gen {t.get('gen', 0):.2f}, "
            f"old_log_prob {t.get('old_log_prob', 0):.2f}, update_critic {t.get('update_critic', 0):.2f}, "
            f"update_actor {t.get('update_actor', 0):.2f}), {result['tokens_per_step']:.0f} tokens/step, "
            f"{result['tokens_per_s']:.0f} tokens/s (generation, {result['engine']} engine: "
            f"{result['gen_tokens_per_s']:.0f} tokens/s); MFU (6*N*tokens/step) {result['mfu_6nt_step']:.2%}, "
            f"actor update {result['mfu_actor_update']:.2%}, all passes {result['mfu_all_passes_step']:.2%} "
            f"of {result['peak_flops'] / 1e12:.0f} TFLOP/s; host reads per micro-batch "
            f"{result['worker_calls']['reads_per_micro_batch'] or 0:.1f}")


def dry_run(args) -> dict:
    """The CPU side: the config the step would run (validated), its parameter count and the FLOP arithmetic."""
    model_arch = arch(args.arch)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(tmp, arch_name=args.arch, device=args.device, steps=args.steps, batch=args.batch,
                           response_length=args.response_length, micro_batch=args.micro_batch, engine=args.engine,
                           micro_tokens=args.micro_tokens)
    n = params(model_arch)
    tokens = args.batch * (40 + args.response_length)  # ~40 prompt tokens per arithmetic prompt
    out = {"arch": args.arch, "engine": cfg.rollout.name, "actor_params": n,
           "arch_num_parameters": model_arch.num_parameters(),
           "roles": cfg.roles, "launcher": cfg.cluster.launcher, "device": cfg.cluster.device,
           "dtype": cfg.actor.model.dtype, "peak_flops": args.peak_tflops * 1e12,
           "flops_per_step_estimate": step_model_flops(n, params(model_arch, "critic"), tokens,
                                                       args.batch * args.response_length)}
    print(f"ppo_step (dry run): {args.arch} {n:,} params ({'=' if n == QWEN2_0P5B_PARAMS else '!='} Qwen2.5-0.5B's "
          f"{QWEN2_0P5B_PARAMS:,}), roles {cfg.roles}, launcher={cfg.cluster.launcher}, device={cfg.cluster.device}, "
          f"{cfg.actor.model.dtype}; ~{tokens} tokens/step -> "
          f"{out['flops_per_step_estimate']['step'] / 1e12:.1f} TFLOP per step (all passes); peak "
          f"{args.peak_tflops:g} TFLOP/s")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(ARCHES), default="qwen2-0.5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=3, help="PPO steps (the first is excluded from the medians)")
    p.add_argument("--batch", type=int, default=128, help="prompts per step (rollout.n = 1)")
    p.add_argument("--response-length", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-batch when --micro-tokens is 0")
    p.add_argument("--micro-tokens", type=int, default=MICRO_TOKENS,
                   help="token budget per micro-batch, every role (use_dynamic_bsz); 0: --micro-batch sequences")
    p.add_argument("--engine", choices=["megatron", "vllm"], default="megatron", help="rollout.name")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_FLOPS / 1e12)
    p.add_argument("--workdir", help="inputs and run logs (default: a temporary directory)")
    p.add_argument("--out", help="write the results JSON here")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.dry_run:
        result = dry_run(args)
    else:
        workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_step_")
        result = run(workdir, arch_name=args.arch, device=args.device, steps=args.steps, batch=args.batch,
                     response_length=args.response_length, micro_batch=args.micro_batch,
                     peak=args.peak_tflops * 1e12, dtype="bfloat16" if args.device == "cuda" else "float32",
                     engine=args.engine, micro_tokens=args.micro_tokens)
        print(describe(result), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
