"""Tiny random HF Llama/Qwen2 models saved to disk (with a real tokenizer.json): the inputs of the conversion
tests. Norms and biases are randomised so that a swapped norm or a dropped bias changes the logits.
"""
from __future__ import annotations

import json
import os

import torch

TINY_VOCAB = 300  # not a multiple of 128 (or 256): exercises vocab padding and un-padding
TINY_KINDS = ("llama", "llama_tied_llama3rope", "qwen2", "qwen2_untied")
REWARD_KINDS = ("llama_rm", "qwen2_rm")  # *ForSequenceClassification, num_labels=1


def make_tiny_hf(kind: str, out_dir: str, seed: int = 0, vocab_size: int = TINY_VOCAB, tokenizer: bool = True) -> str:
    """Save a tiny random HF model of ``kind`` (+ a real tokenizer.json unless ``tokenizer`` is false) to out_dir;
    norms and biases randomised so that a swapped norm or a dropped bias changes the logits."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, Qwen2Config,
                              Qwen2ForCausalLM, Qwen2ForSequenceClassification)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
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
    elif kind == "llama_rm":  # pad_token_id: HF scores the last non-pad token (token 0 never occurs in tests' rows)
        model = LlamaForSequenceClassification(LlamaConfig(**common, num_labels=1, pad_token_id=0))
    elif kind == "qwen2_rm":
        model = Qwen2ForSequenceClassification(Qwen2Config(**common, num_labels=1, pad_token_id=0,
                                                           tie_word_embeddings=True))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name == "score.weight":  # HF initialises it at std 0.02: scores near 0 would compare weakly
                p.normal_(0.0, 1.0)
    model.eval().save_pretrained(out_dir)
    if not tokenizer:
        return out_dir
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)
    return out_dir
