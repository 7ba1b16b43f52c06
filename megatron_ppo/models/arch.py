"""ModelArch: the architecture of a Llama/Qwen2-family decoder, independent of parallel layout.

It is what an HF config maps to (``convert.mapping.arch_from_hf_config``) and what ``build_gpt_model`` turns
into a Megatron ``TransformerConfig``; the parallel layout (TP/PP/SP) and dtype are not part of it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_NORMALIZATIONS = ("RMSNorm", "LayerNorm")
SUPPORTED_ACTIVATIONS = ("swiglu", "gelu", "silu")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArch:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float = 10000.0
    rope_scaling: dict | None = None  # HF-style: {"rope_type": "llama3"|"linear", "factor": ..., ...}
    norm_epsilon: float = 1e-6
    add_qkv_bias: bool = False  # Qwen2
    tie_word_embeddings: bool = False
    normalization: str = "RMSNorm"
    activation: str = "swiglu"
    kv_channels: int | None = None  # head dim; None = hidden_size // num_attention_heads
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (e.g. HF model_type)

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"ModelArch: {msg}")

        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "max_position_embeddings", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}")
        need(self.num_attention_heads % self.num_query_groups == 0,
             f"num_attention_heads={self.num_attention_heads} is not a multiple of "
             f"num_query_groups={self.num_query_groups}")
        need(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads};"
             " set kv_channels")
        need(self.normalization in SUPPORTED_NORMALIZATIONS,
             f"normalization={self.normalization!r} not in {SUPPORTED_NORMALIZATIONS}")
        need(self.activation in SUPPORTED_ACTIVATIONS, f"activation={self.activation!r} not in {SUPPORTED_ACTIVATIONS}")
        need(self.rotary_base > 0, f"rotary_base must be > 0, got {self.rotary_base}")
        need(self.norm_epsilon > 0, f"norm_epsilon must be > 0, got {self.norm_epsilon}")
        self.rope_config()  # validates rope_scaling

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's vocab padding: a multiple of make_vocab_size_divisible_by * tp (>= vocab_size)."""
        if tp < 1:
            raise ValueError(f"padded_vocab_size: tp must be >= 1, got {tp}")
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def rope_config(self) -> dict:
        """Normalised rope scaling: {"rope_type": "default"} or the llama3 / linear parameters."""
        rs = self.rope_scaling
        if not rs:
            return {"rope_type": "default"}
        if not isinstance(rs, dict):
            raise ValueError(f"ModelArch: rope_scaling must be a dict or None, got {type(rs).__name__}")
        rope_type = rs.get("rope_type", rs.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"ModelArch: rope_scaling type {rope_type!r} is not supported "
                             f"(supported: {SUPPORTED_ROPE_TYPES})")
        if rope_type == "default":
            return {"rope_type": "default"}
        if "factor" not in rs:
            raise ValueError(f"ModelArch: rope_scaling of type {rope_type!r} needs 'factor'")
        out = {"rope_type": rope_type, "factor": float(rs["factor"])}
        if rope_type == "llama3":
            for key, default in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                 ("original_max_position_embeddings", 8192)):
                out[key] = rs.get(key, default)
        return out

    def num_parameters(self, tp: int = 1) -> int:
        """Parameter count (unpadded vocab), for MFU and memory estimates."""
        h, f, L = self.hidden_size, self.ffn_hidden_size, self.num_layers
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.num_query_groups * self.head_dim
        attn = h * (q + kv) + q * h + (q + kv if self.add_qkv_bias else 0)
        mlp = h * f * (3 if self.activation == "swiglu" else 2)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * per_layer + emb + h

    def replace(self, **changes) -> "ModelArch":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArch":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"ModelArch.from_dict: unknown keys {sorted(unknown)}")
        return cls(**d)


def tiny_arch(**overrides) -> ModelArch:
    """A 2-layer, hidden-64 Llama-style model with GQA: the model of the CPU tests and benchmarks."""
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                vocab_size=512, max_position_embeddings=256, rotary_base=10000.0, norm_epsilon=1e-6)
    base.update(overrides)
    return ModelArch(**base)
