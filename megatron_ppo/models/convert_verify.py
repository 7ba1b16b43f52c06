"""Proof that a conversion lost nothing: load a dist checkpoint into a Megatron model, compare its logits with the
HF model's, and compare two HF checkpoint directories tensor by tensor (bitwise).

Used by the tests, the benchmark and ``megatron-ppo convert verify``.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megatron_ppo.models.convert_hf_io import HFCheckpoint


def load_dist_checkpoint(model, ckpt_dir: str, strict: bool = True) -> None:
    """Load ``ckpt_dir`` into ``model`` (any TP/PP; call on every rank of the model's groups).

    strict: also fail on checkpoint keys the model does not have (megatron's default only fails on missing ones).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, ckpt_dir,
                                    strict=StrictHandling.RAISE_ALL if strict else StrictHandling.ASSUME_OK_UNEXPECTED)
    result = model.load_state_dict(state, strict=True)
    if result is not None and (result.missing_keys or result.unexpected_keys):
        raise RuntimeError(f"load_state_dict: missing {result.missing_keys}, unexpected {result.unexpected_keys}")


@torch.no_grad()
def megatron_stage_forward(model, input_ids: torch.Tensor, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
    """One pipeline stage's forward on [b, s] tokens: hidden states out of a middle stage, full-vocab (padded)
    logits [b, s, Vp] out of the last (gathered over TP). Causal attention, positions 0..s-1."""
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    if hidden_in is not None:
        model.set_input_tensor(hidden_in)
    return model(input_ids, position_ids, None, runtime_gather_output=True)


@torch.no_grad()
def megatron_logits(model, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocab logits [b, s, vocab_size] through all pipeline stages (point-to-point between stages).

    Every rank calls it; the last stage returns the logits, the others None.
    """
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return megatron_stage_forward(model, input_ids)[..., :vocab_size].float()
    rank = ps.get_pipeline_model_parallel_rank()
    b, s = input_ids.shape
    hidden_in = None
    if rank > 0:
        hidden_in = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(hidden_in, src=ps.get_pipeline_model_parallel_prev_rank())
    out = megatron_stage_forward(model, input_ids, hidden_in)
    if rank < pp - 1:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out[..., :vocab_size].float()


@torch.no_grad()
def megatron_greedy(model, input_ids: torch.Tensor, vocab_size: int, new_tokens: int) -> torch.Tensor:
    """Greedy continuation by full re-forwards (no cache): slow but independent of any generation code (PP=1)."""
    ids = input_ids
    for _ in range(new_tokens):
        nxt = megatron_logits(model, ids, vocab_size)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, input_ids.shape[1]:]


def compare_hf_checkpoints(dir_a: str, dir_b: str) -> list[str]:
    """Differences between two HF checkpoint dirs: names, dtypes, shapes, and any bit of any tensor."""
    a, b = HFCheckpoint(dir_a), HFCheckpoint(dir_b)
    diffs = [f"only in {dir_a}: {n}" for n in sorted(set(a.entries) - set(b.entries))]
    diffs += [f"only in {dir_b}: {n}" for n in sorted(set(b.entries) - set(a.entries))]
    for name in sorted(set(a.entries) & set(b.entries)):
        ta, tb = a.read([name])[name], b.read([name])[name]
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            diffs.append(f"{name}: {ta.dtype} {tuple(ta.shape)} vs {tb.dtype} {tuple(tb.shape)}")
        elif not torch.equal(ta.view(torch.uint8) if ta.dim() else ta, tb.view(torch.uint8) if tb.dim() else tb):
            diffs.append(f"{name}: values differ (max abs {float((ta.float() - tb.float()).abs().max()):.3g})")
    return diffs


# ----------------------------------------------------------------------------------------------------------------
# Tiny random HF models (tests, demos)
# ----------------------------------------------------------------------------------------------------------------
TINY_VOCAB = 300  # not a multiple of 128 (or 256): exercises vocab padding and un-padding
TINY_KINDS = ("llama", "llama_tied_llama3rope", "qwen2", "qwen2_untied")


def make_tiny_hf(kind: str, out_dir: str, seed: int = 0) -> str:
    """Save a tiny random HF model of ``kind`` (+ a real tokenizer.json) to out_dir; norms and biases randomised
    so that a swapped norm or a dropped bias changes the logits."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif kind == "llama_tied_llama3rope":
        common.update(num_key_value_heads=4)  # plain multi-head attention
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 2.0, "original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    elif kind == "qwen2_untied":
        common.update(num_key_value_heads=1)
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.eval().save_pretrained(out_dir)
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)
    return out_dir
