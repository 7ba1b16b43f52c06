"""The HF <-> Megatron-core mapping for Llama and Qwen2, in one place.

Everything here is pure (no I/O, no torch.distributed): which HF tensors make which Megatron checkpoint tensor,
how they are fused (QKV per query group, gate/up for SwiGLU), how the vocabulary is padded, how a TP rank's slice
and a PP stage's layers are found. convert/pipeline.py streams checkpoints through these functions piece by piece.

Megatron-side names are the keys of ``GPTModel.sharded_state_dict()`` (dist_checkpointing), not module names:
the local spec maps ``input_layernorm.`` / ``pre_mlp_layernorm.`` to the TE-style
``self_attention.linear_qkv.layer_norm_`` / ``mlp.linear_fc1.layer_norm_`` keys, and layers are stacked along a
leading axis of size num_layers (key ``decoder.layers.<module>``, layer i at offset i), so one checkpoint serves
every TP/PP layout and both the local and the Transformer-Engine specs.

Global (TP-independent) layouts, as megatron-core 0.16.1 reads them:
- ``linear_qkv``: rows grouped per query group g: [q heads of g (np/ng of them), k_g, v_g], i.e. a
  [ng, np/ng + 2, hn] view of the rows (SelfAttention.get_query_key_value_tensors). A TP rank holds a contiguous
  1/tp of the rows (ng/tp whole groups, or a slice of one group when tp > ng).
- ``linear_fc1`` (SwiGLU): cat(gate, up) over the full ffn; a TP rank holds cat(gate_r, up_r) locally, which
  megatron's swiglu sharded factory stores as chunk r and chunk tp + r of 2*tp.
- ``word_embeddings`` / ``output_layer``: vocab rows padded with zeros to ``arch.padded_vocab_size(tp)``. An HF
  tensor must have exactly ``vocab_size`` rows; a Megatron one the vocab or its padding at a TP megatron allows
  (``vocab_rows``): anything else is another vocabulary and raises instead of being zero-filled or truncated.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from megatron_ppo.errors import UsageError
from megatron_ppo.models.arch import ModelArch
from megatron_ppo.models.vocab_rows import vocab_rows_problem


class ConversionError(UsageError):
    """A checkpoint or config cannot be converted faithfully; the message names the tensor, key, file or field."""


SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
# Reward models (one score per sequence): the backbone plus ``score.weight`` [1, hidden], which becomes the value
# head (``output_layer.weight`` [1, hidden], replicated over TP) of a critic/reward GPTModel.
SCORE_ARCHITECTURES = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification")

# Megatron dist-checkpoint keys (without the optional prefix).
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"
QKV_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
QKV_WEIGHT = "decoder.layers.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
PROJ_WEIGHT = "decoder.layers.self_attention.linear_proj.weight"
FC1_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
FC1_WEIGHT = "decoder.layers.mlp.linear_fc1.weight"
FC2_WEIGHT = "decoder.layers.mlp.linear_fc2.weight"
# Linear modules whose (weightless) ``_extra_state`` megatron stores as one ShardedObject per layer.
EXTRA_STATE_KEYS = tuple(
    f"decoder.layers.{m}._extra_state"
    for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
)

# HF tensors that are derived buffers, not parameters: recognised and skipped (counted in the summary).
DERIVED_HF_BUFFERS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def hf_layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


HF_EMBED = "model.embed_tokens.weight"
HF_NORM = "model.norm.weight"
HF_LM_HEAD = "lm_head.weight"
HF_SCORE = "score.weight"


def has_score_head(arch: ModelArch) -> bool:
    """True for an HF *ForSequenceClassification reward model (``score.weight``, no LM head)."""
    return arch.extra.get("hf_head") == "score"


# ----------------------------------------------------------------------------------------------------------------
# HF config -> ModelArch
# ----------------------------------------------------------------------------------------------------------------
def load_hf_config(source: Any):
    """A transformers PretrainedConfig from a config object, a config dict, a config.json path or a model dir.

    Going through transformers fills in the model type's defaults exactly as transformers would when loading the
    model (e.g. tie_word_embeddings, v4 ``rope_scaling`` -> v5 ``rope_parameters``). Local files only.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, Mapping):
        d = dict(source)
        model_type = d.pop("model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConversionError(f"HF config: model_type {model_type!r} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        return AutoConfig.for_model(model_type, **d)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"HF config: {path} does not exist")
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ConversionError(f"HF config: {path} is not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ConversionError(f"HF config: {path} does not hold a JSON object")
    return load_hf_config(d)


def _rope_from_hf(d: dict) -> tuple[float, dict | None]:
    """(rotary_base, rope_scaling) from a transformers config dict (v5 rope_parameters or v4 rope_theta/scaling)."""
    params = d.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params and "rope_theta" not in params:
        raise ConversionError("HF config: per-layer-type rope_parameters are not supported")
    if params is None:  # transformers v4 layout
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    params = dict(params)
    base = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return base, None
    params["rope_type"] = rope_type
    params.pop("type", None)
    return base, params


def arch_from_hf_config(hf_config: Any) -> ModelArch:
    """ModelArch of an HF Llama or Qwen2 causal LM; anything the Megatron model could not reproduce is an error."""
    cfg = load_hf_config(hf_config)
    d = cfg.to_dict()
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"HF config: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    archs = d.get("architectures") or []
    bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES + SCORE_ARCHITECTURES]
    if bad:
        raise ConversionError(f"HF config: architectures {bad} are not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES + SCORE_ARCHITECTURES)})")
    score = any(a in SCORE_ARCHITECTURES for a in archs)
    if score and any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ConversionError(f"HF config: architectures {archs} mix a causal LM and a sequence classifier")
    extra = {"hf_model_type": model_type}
    if score:
        labels = d.get("num_labels") or len(d.get("id2label") or {}) or 2  # transformers' default is 2
        if labels != 1:
            raise ConversionError(f"HF config: num_labels={labels}: a reward model has one score per sequence "
                                  "(num_labels=1)")
        extra["hf_head"] = "score"

    def need(cond: bool, field_name: str, msg: str):
        if not cond:
            raise ConversionError(f"HF config ({model_type}): {field_name}: {msg}")

    need(d.get("hidden_act", "silu") == "silu", "hidden_act", f"{d.get('hidden_act')!r} (only silu/SwiGLU)")
    if model_type == "llama":
        need(not d.get("attention_bias", False), "attention_bias", "True is not supported (Llama without biases)")
        need(not d.get("mlp_bias", False), "mlp_bias", "True is not supported")
    if model_type == "qwen2":
        need(not d.get("use_sliding_window", False), "use_sliding_window",
             "True is not supported (full attention only)")
    heads = d["num_attention_heads"]
    kv_heads = d.get("num_key_value_heads") or heads
    hidden = d["hidden_size"]
    head_dim = d.get("head_dim") or hidden // heads
    rotary_base, rope_scaling = _rope_from_hf(d)
    partial = d.get("partial_rotary_factor", 1.0)
    need(partial in (None, 1.0), "partial_rotary_factor", f"{partial} (only full rotary)")
    try:
        return ModelArch(
            num_layers=d["num_hidden_layers"],
            hidden_size=hidden,
            ffn_hidden_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=kv_heads,
            vocab_size=d["vocab_size"],
            max_position_embeddings=d["max_position_embeddings"],
            rotary_base=rotary_base,
            rope_scaling=rope_scaling,
            norm_epsilon=float(d["rms_norm_eps"]),
            add_qkv_bias=(model_type == "qwen2"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            normalization="RMSNorm",
            activation="swiglu",
            kv_channels=None if head_dim * heads == hidden else head_dim,
            attention_dropout=float(d.get("attention_dropout", 0.0) or 0.0),
            hidden_dropout=0.0,
            init_method_std=float(d.get("initializer_range", 0.02)),
            extra=extra,
        )
    except KeyError as e:
        raise ConversionError(f"HF config ({model_type}): missing field {e.args[0]!r}") from e
    except ValueError as e:
        raise ConversionError(f"HF config ({model_type}): {e}") from e


def hf_config_dict(arch: ModelArch, dtype: str = "float32") -> dict:
    """The HF config.json of a causal LM with this architecture: the inverse of ``arch_from_hf_config`` (Llama;
    Qwen2 where the QKV projection has biases), for an engine that loads our weights as an HF model."""
    model_type = arch.extra.get("hf_model_type") or ("qwen2" if arch.add_qkv_bias else "llama")
    if (model_type == "qwen2") != arch.add_qkv_bias or model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"no HF model type for this architecture (hf_model_type={model_type!r}, "
                              f"add_qkv_bias={arch.add_qkv_bias})")
    if arch.normalization != "RMSNorm" or arch.activation != "swiglu":
        raise ConversionError(f"no HF {model_type} config for normalization={arch.normalization}, "
                              f"activation={arch.activation} (RMSNorm + SwiGLU only)")
    rope = {"rope_type": "default", "rope_theta": float(arch.rotary_base)}
    if arch.rope_scaling:
        rope = {**arch.rope_scaling, "rope_theta": float(arch.rotary_base)}
    d = {"architectures": [SUPPORTED_ARCHITECTURES[SUPPORTED_MODEL_TYPES.index(model_type)]],
         "model_type": model_type, "hidden_size": arch.hidden_size, "intermediate_size": arch.ffn_hidden_size,
         "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_attention_heads,
         "num_key_value_heads": arch.num_query_groups, "vocab_size": arch.vocab_size,
         "max_position_embeddings": arch.max_position_embeddings, "rms_norm_eps": arch.norm_epsilon,
         "rope_parameters": rope, "tie_word_embeddings": arch.tie_word_embeddings, "hidden_act": "silu",
         "attention_dropout": arch.attention_dropout, "initializer_range": arch.init_method_std,
         "head_dim": arch.kv_channels or arch.hidden_size // arch.num_attention_heads, "dtype": dtype}
    if model_type == "llama":
        d.update(attention_bias=False, mlp_bias=False)
    else:
        d.update(use_sliding_window=False)
    return d


# ----------------------------------------------------------------------------------------------------------------
# Parallel layout
# ----------------------------------------------------------------------------------------------------------------
def validate_layout(arch: ModelArch, tp: int, pp: int) -> None:
    """The divisibility megatron-core requires for a TP x PP model of this arch, as one clear error."""
    problems = []
    if tp < 1 or pp < 1:
        problems.append(f"tp={tp} and pp={pp} must be >= 1")
    else:
        if arch.num_attention_heads % tp:
            problems.append(f"num_attention_heads={arch.num_attention_heads} is not divisible by tp={tp}")
        ng = arch.num_query_groups
        if ng % tp and tp % ng:
            problems.append(f"num_query_groups={ng} is neither a multiple nor a divisor of tp={tp}")
        if arch.ffn_hidden_size % tp:
            problems.append(f"ffn_hidden_size={arch.ffn_hidden_size} is not divisible by tp={tp}")
        if arch.num_layers % pp:
            problems.append(f"num_layers={arch.num_layers} is not divisible by pp={pp}")
    if problems:
        raise ConversionError("layout TP=%d PP=%d is impossible for this model: %s" % (tp, pp, "; ".join(problems)))


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Global layer indices held by each pipeline stage (megatron's even split)."""
    if pp < 1 or num_layers % pp:
        raise ConversionError(f"num_layers={num_layers} is not divisible by pp={pp}")
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def tp_chunks(tensor: torch.Tensor, axis: int, parts: int) -> list[torch.Tensor]:
    """The ``parts`` contiguous slices along ``axis`` (TP ranks' shards), each owning its own storage (megatron's
    writer would otherwise clone a view of a larger storage itself)."""
    if tensor.shape[axis] % parts:
        raise ConversionError(f"cannot split size {tensor.shape[axis]} of axis {axis} into {parts} TP parts")
    if parts == 1:
        return [tensor.contiguous()]
    return [c.clone(memory_format=torch.contiguous_format) for c in torch.chunk(tensor, parts, dim=axis)]


# ----------------------------------------------------------------------------------------------------------------
# The tensor map
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMap:
    """One Megatron checkpoint tensor (one layer's slice, for layer tensors) and the HF tensors it is made of.

    kind: "copy" (same tensor), "qkv" (q, k, v fused per query group), "gate_up" (cat(gate, up)),
    "vocab" (rows padded to the padded vocab). tp_axis/tp_parts: how a TP rank's shard is cut (None: replicated).
    """

    mcore_key: str
    hf_names: tuple[str, ...]
    shape: tuple[int, ...]
    kind: str
    tp_axis: int | None
    tp_parts: int
    layer: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """A unit of streaming: the embedding, one decoder layer, or the final norm + output layer."""

    name: str
    maps: tuple[TensorMap, ...]
    layer: int | None = None

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(n for m in self.maps for n in m.hf_names)


def hf_tensor_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every parameter an HF checkpoint of this arch holds, in file order, with its shape."""
    h, f, hn = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hn, arch.num_query_groups * hn
    shapes = {HF_EMBED: (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = hf_layer_prefix(i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if arch.add_qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes[HF_NORM] = (h,)
    if has_score_head(arch):
        shapes[HF_SCORE] = (1, h)
    elif not arch.tie_word_embeddings:
        shapes[HF_LM_HEAD] = (arch.vocab_size, h)
    return shapes


def conversion_pieces(arch: ModelArch, tp: int) -> list[Piece]:
    """The whole model as streaming pieces in HF file order; ``tp`` fixes vocab padding and the TP shard cuts."""
    h, f, hn = arch.hidden_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * hn, arch.num_query_groups * hn
    vp = arch.padded_vocab_size(tp)
    pieces = [Piece("embedding", (TensorMap(EMBEDDING, (HF_EMBED,), (vp, h), "vocab", 0, tp),))]
    for i in range(arch.num_layers):
        p = hf_layer_prefix(i)
        qkv = tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")
        maps = [
            TensorMap(QKV_NORM, (p + "input_layernorm.weight",), (h,), "copy", None, 1, i),
            TensorMap(QKV_WEIGHT, qkv, (q + 2 * kv, h), "qkv", 0, tp, i),
        ]
        if arch.add_qkv_bias:
            qkv_b = tuple(p + f"self_attn.{x}_proj.bias" for x in "qkv")
            maps.append(TensorMap(QKV_BIAS, qkv_b, (q + 2 * kv,), "qkv", 0, tp, i))
        maps += [
            TensorMap(PROJ_WEIGHT, (p + "self_attn.o_proj.weight",), (h, q), "copy", 1, tp, i),
            TensorMap(FC1_NORM, (p + "post_attention_layernorm.weight",), (h,), "copy", None, 1, i),
            TensorMap(FC1_WEIGHT, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), (2 * f, h), "gate_up",
                      0, 2 * tp, i),
            TensorMap(FC2_WEIGHT, (p + "mlp.down_proj.weight",), (h, f), "copy", 1, tp, i),
        ]
        pieces.append(Piece(f"layer_{i:04d}", tuple(maps), i))
    final = [TensorMap(FINAL_NORM, (HF_NORM,), (h,), "copy", None, 1)]
    if has_score_head(arch):  # the value head: [1, h], the same on every TP rank
        final.append(TensorMap(OUTPUT_LAYER, (HF_SCORE,), (1, h), "copy", None, 1))
    elif not arch.tie_word_embeddings:
        final.append(TensorMap(OUTPUT_LAYER, (HF_LM_HEAD,), (vp, h), "vocab", 0, tp))
    pieces.append(Piece("final", tuple(final)))
    return pieces


def mcore_key_shapes(arch: ModelArch, tp: int) -> dict[str, tuple[int, ...]]:
    """Global shapes of every Megatron checkpoint tensor (layer tensors stacked: leading axis num_layers)."""
    out: dict[str, tuple[int, ...]] = {}
    for piece in conversion_pieces(arch, tp):
        for m in piece.maps:
            out[m.mcore_key] = m.shape if m.layer is None else (arch.num_layers,) + m.shape
    return out


# ----------------------------------------------------------------------------------------------------------------
# The transforms (pure; exact inverses of each other)
# ----------------------------------------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """[q; k; v] (HF) -> megatron's per-group interleave [ng, (np/ng + 2) * hn, ...] flattened to rows."""
    ng, hn = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(ng, per * hn, *rest), k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)], dim=1
    ).reshape(ng * (per + 2) * hn, *rest)


def split_qkv(qkv: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv."""
    ng, hn = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per + 2) * hn, *rest)
    q, k, v = torch.split(grouped, [per * hn, hn, hn], dim=1)
    return (q.reshape(ng * per * hn, *rest).contiguous(), k.reshape(ng * hn, *rest).contiguous(),
            v.reshape(ng * hn, *rest).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to the padded vocab (megatron's make_vocab_size_divisible_by * tp)."""
    extra = padded_rows - weight.shape[0]
    if extra < 0:
        raise ConversionError(f"vocab rows {weight.shape[0]} exceed the padded vocab {padded_rows}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros((extra,) + tuple(weight.shape[1:]))], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first vocab_size rows, the padding rows dropped) — the caller reports what the padding held."""
    if weight.shape[0] < vocab_size:
        raise ConversionError(f"vocab rows {weight.shape[0]} are fewer than the vocab size {vocab_size}")
    return weight[:vocab_size].contiguous(), weight[vocab_size:]


def to_mcore(m: TensorMap, hf: Mapping[str, torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """The Megatron tensor of ``m`` (global, per layer) from its HF tensors."""
    ts = [hf[n] for n in m.hf_names]
    if m.kind == "copy":
        out = ts[0]
    elif m.kind == "qkv":
        out = fuse_qkv(*ts, arch)
    elif m.kind == "gate_up":
        out = fuse_gate_up(*ts)
    elif m.kind == "vocab":
        if ts[0].shape[0] != arch.vocab_size:  # pad_vocab would zero-fill the missing real tokens
            raise ConversionError(f"{m.hf_names[0]}: {ts[0].shape[0]} rows, the config's vocab_size is "
                                  f"{arch.vocab_size}")
        out = pad_vocab(ts[0], m.shape[0])
    else:  # pragma: no cover - the map is built above
        raise AssertionError(m.kind)
    if tuple(out.shape) != m.shape:
        raise ConversionError(f"{m.mcore_key} (layer {m.layer}): built shape {tuple(out.shape)}, expected {m.shape}")
    return out


def to_hf(m: TensorMap, tensor: torch.Tensor, arch: ModelArch) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The HF tensors of ``m`` from its Megatron tensor, plus the vocab padding rows dropped (or None)."""
    dropped = None
    if m.kind == "copy":
        parts = (tensor,)
    elif m.kind == "qkv":
        parts = split_qkv(tensor, arch)
    elif m.kind == "gate_up":
        parts = split_gate_up(tensor)
    elif m.kind == "vocab":
        problem = vocab_rows_problem(tensor.shape[0], arch)
        if problem:  # unpad_vocab would drop real tokens of a larger vocabulary
            raise ConversionError(f"{m.mcore_key}: {problem}")
        kept, dropped = unpad_vocab(tensor, arch.vocab_size)
        parts = (kept,)
    else:  # pragma: no cover
        raise AssertionError(m.kind)
    return dict(zip(m.hf_names, parts)), dropped


@dataclass(frozen=True)
class Segment:
    """Rows [dst, dst + stop - start) of a box of a Megatron tensor are rows [start, stop) of HF tensor ``hf_name``
    (None: vocab padding rows, zeros). Columns map one to one."""

    hf_name: str | None
    start: int
    stop: int
    dst: int


def row_segments(m: TensorMap, arch: ModelArch, r0: int, r1: int) -> list[Segment]:
    """Where rows [r0, r1) of ``m``'s Megatron tensor (one layer's) come from: the reads of a rank whose shard is
    those rows, in ``dst`` order. The inverse of ``to_mcore`` restricted to a row range, so a rank reads exactly
    its own rows: a slice of q, k and v per query group it holds, its block of gate and of up, its vocab rows."""
    if not 0 <= r0 <= r1:
        raise ConversionError(f"{m.mcore_key}: bad row range [{r0}, {r1})")
    if m.kind == "copy":
        if r1 > m.shape[0]:
            raise ConversionError(f"{m.mcore_key}: rows [{r0}, {r1}) exceed {m.shape[0]}")
        return [Segment(m.hf_names[0], r0, r1, 0)] if r1 > r0 else []
    if m.kind == "vocab":  # rows past the vocab are megatron's padding: zeros, read from nowhere
        v = arch.vocab_size
        out = [Segment(m.hf_names[0], r0, min(r1, v), 0)] if r0 < min(r1, v) else []
        if r1 > max(r0, v):
            out.append(Segment(None, max(r0, v), r1, max(r0, v) - r0))
        return out
    if m.kind == "gate_up":
        f = arch.ffn_hidden_size
        if r1 > 2 * f:
            raise ConversionError(f"{m.mcore_key}: rows [{r0}, {r1}) exceed {2 * f}")
        gate, up = m.hf_names
        out = [Segment(gate, r0, min(r1, f), 0)] if r0 < min(r1, f) else []
        if r1 > max(r0, f):
            out.append(Segment(up, max(r0, f) - f, r1 - f, max(r0, f) - r0))
        return out
    if m.kind == "qkv":  # rows per query group g: [q heads of g, k_g, v_g] (fuse_qkv)
        ng, hn = arch.num_query_groups, arch.head_dim
        per = arch.num_attention_heads // ng
        size = (per + 2) * hn
        if r1 > ng * size:
            raise ConversionError(f"{m.mcore_key}: rows [{r0}, {r1}) exceed {ng * size}")
        q, k, v = m.hf_names
        parts = ((q, 0, per * hn), (k, per * hn, hn), (v, (per + 1) * hn, hn))  # name, offset in group, rows
        out = []
        for g in range(r0 // size, -(-r1 // size)):
            for name, off, n in parts:
                lo, hi = max(r0, g * size + off), min(r1, g * size + off + n)
                if lo < hi:
                    start = g * n + lo - g * size - off
                    out.append(Segment(name, start, start + hi - lo, lo - r0))
        return out
    raise AssertionError(m.kind)  # pragma: no cover - the map is built above


def classify_hf_names(arch: ModelArch, names: Iterable[str]) -> dict[str, list[str]]:
    """Split checkpoint tensor names into expected / derived buffers (skipped) / tied duplicate / unknown."""
    expected = hf_tensor_shapes(arch)
    out: dict[str, list[str]] = {"expected": [], "derived": [], "tied_duplicate": [], "unknown": []}
    for n in names:
        if n in expected:
            out["expected"].append(n)
        elif DERIVED_HF_BUFFERS.match(n):
            out["derived"].append(n)
        elif n == HF_LM_HEAD and arch.tie_word_embeddings and not has_score_head(arch):
            out["tied_duplicate"].append(n)
        else:
            out["unknown"].append(n)
    return out
