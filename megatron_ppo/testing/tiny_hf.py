"""Tiny random HF Llama/Qwen2 models saved to disk (with a real tokenizer.json): the inputs of the conversion
tests. Norms and biases are randomised so that a swapped norm or a dropped bias changes the logits.
"""
from __future__ import annotations

import json
import os

import torch

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
