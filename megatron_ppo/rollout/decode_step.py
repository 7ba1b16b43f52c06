"""The Megatron engine's static step: one forward of a ``GPTModel`` stage over a preallocated KV cache, for a prefill
chunk or the one-token decode step, with no host read and (in decode) no shape that changes between steps.

Why a step of our own and not ``GPTModel.forward`` with megatron's ``StaticInferenceContext``: megatron's cache grows
by Python slices (``k_mem[:pos+1]``), its offset is a Python int, its attention takes the core-attention module
(TE's takes no arbitrary mask), it re-rotates the whole cached key every step and rebuilds the rotary table in every
layer. A CUDA graph replays fixed addresses and shapes, so the decode step here is written for that
(docs/rollout.md, "The static decode step"):

* **Static cache**: ``StaticKVCache`` holds, per layer, K and V as ``[batch, groups, max_len, head_dim]`` (zeros,
  allocated once per rollout for prompt width + max response). A step writes its keys (RoPE-rotated, at their
  columns) with ``index_copy_`` at device-side column indices; the decode step attends over the whole cache with a
  boolean mask built on the device from the row's first prompt column and the current position.
* **Rotary** cos / sin once per forward (megatron's unfused formula, the same elementwise ops), not per layer.
* **GQA without the math backend**: in decode the ``heads / groups`` query heads of a group become the query rows of
  one SDPA call over that group's keys (``[B, groups, heads_per_group, d]`` against ``[B, groups, S, d]``), so K/V
  are never repeated and the mask broadcasts; in prefill K/V are repeated to the query heads for the chunk only, so
  SDPA keeps a fused (memory-efficient / CPU flash) kernel with a mask — never ``enable_gqa`` with a mask, which
  sends SDPA to its math backend (an fp32 ``[B, H, s, s]`` matrix on a GPU).
* **Modules, not a copy of them**: norms, ``get_query_key_value_tensors`` (so Transformer Engine's fused
  layer-norm + QKV projection too), ``linear_proj``, megatron's bias-dropout-add, ``mlp``, the final norm and the
  output layer are the layer's own modules; only the core attention (whichever the spec has: ours, megatron's
  local, TE's) is replaced by the SDPA call over the static cache. Tensor parallelism works through the modules'
  own collectives.

With megatron's own linear layers the step runs their GEMMs itself (``_Linear``: ``F.linear`` on the parameters,
the modules' collectives and biases in their order: row-parallel outputs all-reduced over TP before their bias, the
output layer's logits all-gathered); Transformer Engine's layers are called as modules. On CPU in fp32 the GEMMs run
on weights prepacked for oneDNN (``packed_linears``): megatron's linear layers call MKL's sgemm, which at a decode
step's few rows runs well below oneDNN's prepacked kernel on the CPUs measured (docs/bench/peer.md, "What session 3
changed", item 5). Packing is a small fixed cost per rollout (the actor's weights change between rollouts).

``unsupported_reason(core)`` lists what the step does not cover (MoE, MLA, cross-attention, gated attention output,
learned absolute positions, sliding windows...); generation then takes megatron's full forward and says so in one
WARNING line.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _rotate_half
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer


def unsupported_reason(core) -> str | None:
    """None when the static step reproduces this model stage's forward, else why not (generation falls back)."""
    cfg = core.config
    flags = {
        "position_embedding_type != rope": getattr(core, "position_embedding_type", None) != "rope",
        "multi_latent_attention": getattr(cfg, "multi_latent_attention", False),
        "attention_output_gate": getattr(cfg, "attention_output_gate", False),
        "context_parallel_size > 1": cfg.context_parallel_size != 1,
        "fp32_residual_connection": cfg.fp32_residual_connection,
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "multi-token prediction": getattr(core, "mtp_process", False),
        "window_size (sliding-window attention)": getattr(cfg, "window_size", None) is not None,
        "softmax_type != vanilla": getattr(cfg, "softmax_type", "vanilla") != "vanilla",
        "mrope": getattr(cfg, "mrope_section", None) is not None,
    }
    bad = [name for name, on in flags.items() if on]
    for layer in core.decoder.layers:
        if not isinstance(layer, TransformerLayer):
            bad.append(f"layer {type(layer).__name__}")
        elif not isinstance(layer.self_attention, SelfAttention):
            bad.append(f"self_attention {type(layer.self_attention).__name__}")
        elif type(layer.mlp) is not MLP:
            bad.append(f"mlp {type(layer.mlp).__name__}")
        elif not isinstance(layer.cross_attention, (IdentityOp, IdentityFuncOp)):
            bad.append("cross_attention")
        if bad:
            break
    return ", ".join(sorted(set(bad))) or None


def plain_linears(core) -> bool:
    """True where the step can run the layer's GEMMs itself (``_Linear``): megatron's own column / row parallel
    layers (not Transformer Engine's), the activation path unfused (the fused GELU is megatron's tanh approximation,
    which ``_mlp`` does not copy), query groups >= TP. Elsewhere it calls the modules."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if not len(core.decoder.layers):
        return False
    layer = core.decoder.layers[0]
    cfg = core.config
    return (type(layer.self_attention.linear_qkv) is ColumnParallelLinear
            and type(layer.self_attention.linear_proj) is RowParallelLinear
            and type(layer.mlp.linear_fc1) is ColumnParallelLinear and type(layer.mlp.linear_fc2) is RowParallelLinear
            and not cfg.bias_activation_fusion and not getattr(cfg, "use_te_activation_func", False)
            and getattr(cfg, "activation_func_clamp_value", None) is None
            and cfg.num_query_groups >= cfg.tensor_model_parallel_size)


def onednn_packable(core) -> bool:
    """True where those GEMMs can run on oneDNN-prepacked weights: CPU, fp32, torch built with mkldnn."""
    if not plain_linears(core):
        return False
    w = core.decoder.layers[0].self_attention.linear_qkv.weight
    return (w.device.type == "cpu" and w.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class _Linear:
    """A megatron linear layer's inference forward (no sequence parallelism): returns (output, bias) as the module
    does (row-parallel: all-reduce over TP, then the bias unless skip_bias_add). ``rows``: prepack the weight for
    oneDNN at that many input rows; None: ``F.linear`` on the parameter itself (an in-place update is seen). Why
    not the module: megatron's linear forward warns on every call (a deprecation notice for its row-parallel
    layers), which ``torch.compile(fullgraph=True)`` cannot trace, and is much Python per GEMM."""

    def __init__(self, module, rows: int | None, weight=None, gather: bool = False):
        self.weight = module.weight if weight is None else weight
        self.packed = None if rows is None else torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)
        self.bias = module.bias
        self.skip_bias_add = module.skip_bias_add
        self.row_parallel = isinstance(module, RowParallelLinear)
        self.tp_group = module.tp_group
        self.gather = gather

    def __call__(self, x):
        if self.packed is None:
            out = F.linear(x, self.weight)
        else:
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), self.packed, None, "none", [], "")
            out = out.view(*x.shape[:-1], out.size(-1))
        if self.row_parallel:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        if self.gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class StaticKVCache:
    """Per layer (K, V), each ``[batch, groups, max_len, head_dim]``, zero-filled: a column no row writes (its left
    padding) is masked, but a masked NaN would still poison SDPA's weighted sum (0 * NaN)."""

    def __init__(self, core, batch: int, max_len: int, dtype, device):
        self.max_len = max_len
        self.mem = {}
        for layer in core.decoder.layers:
            att = layer.self_attention
            self.mem[att.layer_number] = tuple(
                torch.zeros(batch, att.num_query_groups_per_partition, max_len, dim, dtype=dtype, device=device)
                for dim in (att.key_hidden_size, att.val_hidden_size))

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Only rows ``keep`` (device indices into the current batch; their count is the new batch) stay."""
        for n, (k, v) in self.mem.items():
            self.mem[n] = (k.index_select(0, keep), v.index_select(0, keep))


def rope_cos_sin(freqs: torch.Tensor, mscale: float, dtype):
    """megatron's unfused RoPE factors for ``freqs`` [s, 1, 1, rot_dim]: computed once per forward, used by every
    layer (megatron computes them in each layer, for q and for k)."""
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` on precomputed factors: the same elementwise ops in the same order."""
    rot_dim = cos.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * cos) + (_rotate_half(t, interleaved) * sin)
    return torch.cat((t, t_pass), dim=-1)


def static_attention(q, k, v, keep, scale):
    """q [s, B, heads, d] over the cache's k, v [B, groups, S, d] with ``keep`` [B, 1, s, S] (True = attend, every
    query row keeps at least one key) -> [s, B, heads * d]. Decode (s == 1): each group's query heads are the query
    rows of one SDPA call (no K/V repeat); prefill: K/V repeated to the query heads for this chunk."""
    s, b, heads, d = q.shape
    groups = k.size(1)
    if s == 1:
        qg = q.reshape(b, groups, heads // groups, d)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=keep, scale=scale)  # keep [B, 1, 1, S]
        return out.reshape(1, b, heads * d)
    if groups != heads:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k, v, attn_mask=keep, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


class StaticStep:
    """One forward of this stage over a ``StaticKVCache``.

    ``step(x, cols, keep, cache, rows=slice(None), kv=slice(None), decode=False)``: ``x`` token ids [B, s] on the
    first stage,
    else the previous stage's hidden states [s, B, H]; ``cols`` [s] the cache columns (= rotary positions) of these
    tokens, a device tensor; ``keep`` [B, 1, s, K] the attention mask over cache columns ``kv`` (True = attend);
    ``rows``: the cache rows these B rows are. Returns the last position's logits [B, V_padded] (gathered over TP)
    on the last stage, else the hidden states [s, B, H] to send on. Decode calls it with fixed shapes and device
    tensors only, so it can be captured (``decode``), and runs the GEMMs on the prepacked weights where there are
    some; prefill on plain GEMMs (which the worker's cpu_gemm routing may send to oneDNN)."""

    def __init__(self, core, max_len: int, rows: int, packed: bool = True):
        self.core = core
        self.cfg = core.config
        self.freqs = core.rotary_pos_emb(max_len)  # [max_len, 1, 1, dim]: GPTModel's table for a static context
        self.mscale = _yarn_get_concentration_factor_from_config(self.cfg)
        self.output_weight = core.shared_embedding_or_output_weight() if (
            core.post_process and core.share_embeddings_and_output_weights) else None
        self.packed = packed and onednn_packable(core)
        plain = plain_linears(core)
        self.linears = layer_linears(core, None, self.output_weight) if plain else None  # prefill: plain GEMMs
        self.decode_linears = layer_linears(core, rows, self.output_weight) if self.packed else self.linears
        self.scales = {layer.self_attention.layer_number: _softmax_scale(layer.self_attention)
                       for layer in core.decoder.layers}

    @torch.no_grad()
    def __call__(self, x, cols, keep, cache: StaticKVCache, rows=slice(None), kv=slice(None), decode=False):
        core = self.core
        cos, sin = rope_cos_sin(self.freqs.index_select(0, cols), self.mscale, self.cfg.params_dtype)
        h = _embed(core.embedding, x) if core.pre_process else x
        linears = self.decode_linears if decode else self.linears
        for layer in core.decoder.layers:
            h = self._layer(layer, linears, h, cos, sin, cols, keep, cache, rows, kv)
        if not core.post_process:
            return h
        h = h[-1:]
        if core.decoder.final_layernorm is not None:
            h = core.decoder.final_layernorm(h)
        if linears is not None:
            logits, _ = linears["output"](h)
        else:
            logits, _ = core.output_layer(h, weight=self.output_weight, runtime_gather_output=True)
        return logits[0]

    def decode(self, x, pos, first_col, cache: StaticKVCache, rows=slice(None)):
        """The one-token step: token ids (or hidden states) of the cache rows ``rows`` (all of them by default) at
        column ``pos`` ([1], device); row i attends to columns ``first_col[i] .. pos``. Fixed shapes, no host read:
        capturable."""
        cols = torch.arange(cache.max_len, device=pos.device)
        keep = ((cols >= first_col[:, None]) & (cols <= pos)).view(first_col.size(0), 1, 1, cache.max_len)
        return self(x, pos, keep, cache, rows=rows, decode=True)

    def _layer(self, layer, linears, h, cos, sin, cols, keep, cache, rows, kv):
        att = layer.self_attention
        lin = linears[att.layer_number] if linears is not None else None
        x = layer.input_layernorm(h)
        q, k, v = att.get_query_key_value_tensors(x, None) if lin is None else _split_qkv(att, lin["qkv"](x)[0])
        interleaved = self.cfg.rotary_interleaved
        q = apply_rope(q, cos, sin, interleaved)
        k = apply_rope(k, cos, sin, interleaved)
        k_mem, v_mem = cache.mem[att.layer_number]
        k_mem, v_mem = k_mem[rows], v_mem[rows]
        k_mem.index_copy_(2, cols, k.permute(1, 2, 0, 3))
        v_mem.index_copy_(2, cols, v.permute(1, 2, 0, 3))
        ctx_out = static_attention(q, k_mem[:, :, kv], v_mem[:, :, kv], keep, self.scales[att.layer_number])
        out_with_bias = att.linear_proj(ctx_out) if lin is None else lin["proj"](ctx_out)
        with layer.bias_dropout_add_exec_handler():
            h = layer.self_attn_bda(False, self.cfg.bias_dropout_fusion)(out_with_bias, h, layer.hidden_dropout)
        x = layer.pre_mlp_layernorm(h)
        out_with_bias = layer.mlp(x) if lin is None else _mlp(layer.mlp, lin, x)
        with layer.bias_dropout_add_exec_handler():
            h = layer.mlp_bda(False, self.cfg.bias_dropout_fusion)(out_with_bias, h, layer.hidden_dropout)
        return h


def _embed(embedding, ids):
    """megatron's ``LanguageModelEmbedding`` forward at inference (no position or token-type embeddings, no SP,
    dropout off): [B, s] ids -> [s, B, H]. With TP > 1 megatron's ``VocabParallelEmbedding`` zeroes the other ranks'
    ids and rows by boolean-mask assignment (``x[mask] = 0``: a ``nonzero``, i.e. a host read, every step); there
    the same zeros come from ``masked_fill`` (and the module itself is not called)."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    words = embedding.word_embeddings
    if (type(words) is not VocabParallelEmbedding or getattr(words, "reduce_scatter_embeddings", False)
            or words.tp_group.size() == 1):  # (TP1: megatron's module reads nothing back)
        return embedding(input_ids=ids, position_ids=None)
    outside = (ids < words.vocab_start_index) | (ids >= words.vocab_end_index)
    local = (ids - words.vocab_start_index).masked_fill(outside, 0)
    out = F.embedding(local, words.weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tensor_model_parallel_region(out, group=words.tp_group).transpose(0, 1).contiguous()


def _softmax_scale(att) -> float:
    """The scale the layer's own core attention applies (megatron's default 1/sqrt(head_dim), or config's)."""
    own = getattr(att.core_attention, "softmax_scale", None)
    if own is not None:
        return float(own)
    if att.config.softmax_scale is not None:
        return float(att.config.softmax_scale)
    return 1.0 / math.sqrt(att.hidden_size_per_attention_head)


def layer_linears(core, rows: int | None, output_weight) -> dict:
    """{layer_number: {"qkv", "proj", "fc1", "fc2"}, "output": ...} as ``_Linear`` (prepacked for ``rows``-row
    inputs, or None: on the parameters)."""
    out = {}
    for layer in core.decoder.layers:
        att, mlp = layer.self_attention, layer.mlp
        out[att.layer_number] = {"qkv": _Linear(att.linear_qkv, rows), "proj": _Linear(att.linear_proj, rows),
                                 "fc1": _Linear(mlp.linear_fc1, rows), "fc2": _Linear(mlp.linear_fc2, rows)}
    if core.post_process:
        out["output"] = _Linear(core.output_layer, rows, weight=output_weight, gather=True)
    return out


def _split_qkv(att, mixed):
    """megatron's SelfAttention.get_query_key_value_tensors after its linear_qkv (no output gate, groups >= TP)."""
    ng = att.num_query_groups_per_partition
    per_group = att.num_attention_heads_per_partition // ng
    hn = att.hidden_size_per_attention_head
    mixed = mixed.view(*mixed.shape[:-1], ng, (per_group + 2) * hn)
    query, key, value = torch.split(mixed, [per_group * hn, hn, hn], dim=3)
    query = query.reshape(query.size(0), query.size(1), -1, hn)
    if att.q_layernorm is not None:
        query = att.q_layernorm(query)
    if att.k_layernorm is not None:
        key = att.k_layernorm(key)
    return query, key, value


def _mlp(mlp, lin, x):
    """megatron's MLP.forward (unfused activation path, no clamp) with the step's fc1 / fc2."""
    inter, bias = lin["fc1"](x)
    if bias is not None:
        inter = inter + bias
    cfg = mlp.config
    if cfg.gated_linear_unit:
        x_glu, x_linear = torch.chunk(inter, 2, dim=-1)
        inter = cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)
    else:
        inter = mlp.activation_func(inter)
    return lin["fc2"](inter)
