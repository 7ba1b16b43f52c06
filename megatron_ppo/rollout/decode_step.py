"""A lean one-token decode forward over a megatron ``GPTModel`` stage: the same modules, without the scaffolding.

A decode step at a few rows spends much of its CPU time outside the matmuls (profiles: docs/bench/peer.md), much
of it in the Python of ``GPTModel.forward`` -> ``TransformerBlock`` -> ``TransformerLayer`` -> ``Attention.forward``
(rotary tables rebuilt each step, offload / recompute / fusion / nvtx branches, inference bookkeeping), once per
layer. This step calls the same megatron modules and functions in the same order (norms,
``get_query_key_value_tensors``, megatron's ``apply_rotary_pos_emb``, our ``SDPACoreAttention``, ``linear_proj``,
megatron's bias-dropout-add, ``mlp``, the final norm and the output layer), so the logits are bit-identical to the
full forward (tests/integration/test_generation_decode_step.py), and tensor parallelism works through the
modules' own collectives.

It writes each new key (RoPE-rotated, as ``CachedRopeSelfAttention`` stores the prompt's keys) and value into the
``StaticInferenceContext`` cache at column ``ctx.sequence_len_offset``; the caller advances the offset.

On CPU in fp32 the step's GEMMs run on weights prepacked for oneDNN (``packed_linears``): megatron's linear
layers call MKL's sgemm, which at a decode step's few rows runs well below oneDNN's prepacked kernel on the CPUs
this was measured on. Packing is a small fixed cost per rollout (the actor's weights change between rollouts, so
each rollout packs afresh); both measured in docs/bench/peer.md ("What session 3 changed", item 5; its rollout
profiles show the packing as ``mkldnn::_reorder_linear_weight``). The GEMM's summation order differs from
MKL's, so logits agree to fp32 rounding (~1e-6 relative), not bit for bit; the module path (``packed=False``) is
bit-identical. Collectives and biases follow megatron's linear layers: row-parallel outputs are all-reduced over TP
before their bias, the output layer's logits are all-gathered.

``unsupported_reason(core)`` lists what the step does not cover (MoE, MLA, cross-attention, gated attention output,
learned absolute positions, fused TP inference kernels, Transformer-Engine modules...); generation then takes
megatron's full forward.
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_ppo.models.attention import CachedRopeSelfAttention, SDPACoreAttention


def unsupported_reason(core) -> str | None:
    """None when ``decode_step`` reproduces this model stage's forward, else why not (generation falls back)."""
    cfg = core.config
    flags = {
        "position_embedding_type != rope": getattr(core, "position_embedding_type", None) != "rope",
        "multi_latent_attention": getattr(cfg, "multi_latent_attention", False),
        "flash_decode": cfg.flash_decode,
        "attention_output_gate": getattr(cfg, "attention_output_gate", False),
        "sequence_parallel": cfg.sequence_parallel,
        "context_parallel_size > 1": cfg.context_parallel_size != 1,
        "fp32_residual_connection": cfg.fp32_residual_connection,
        "apply_residual_connection_post_layernorm": cfg.apply_residual_connection_post_layernorm,
        "inference_fuse_tp_communication": getattr(cfg, "inference_fuse_tp_communication", False),
        "multi-token prediction": getattr(core, "mtp_process", False),
    }
    bad = [name for name, on in flags.items() if on]
    for layer in core.decoder.layers:
        if not isinstance(layer, TransformerLayer):
            bad.append(f"layer {type(layer).__name__}")
        elif type(layer.self_attention) is not CachedRopeSelfAttention:
            bad.append(f"self_attention {type(layer.self_attention).__name__}")
        elif type(layer.self_attention.core_attention) is not SDPACoreAttention:
            bad.append(f"core_attention {type(layer.self_attention.core_attention).__name__}")
        elif type(layer.mlp) is not MLP:
            bad.append(f"mlp {type(layer.mlp).__name__}")
        elif not isinstance(layer.cross_attention, (IdentityOp, IdentityFuncOp)):
            bad.append("cross_attention")
        if bad:
            break
    return ", ".join(sorted(set(bad))) or None


def onednn_packable(core) -> bool:
    """True where the GEMMs can run on oneDNN-prepacked weights: CPU, fp32, torch built with mkldnn, megatron's
    activation path unfused (the fused GELU is megatron's tanh approximation, which this step does not copy)."""
    w = core.decoder.layers[0].self_attention.linear_qkv.weight if len(core.decoder.layers) else None
    cfg = core.config
    return (w is not None and w.device.type == "cpu" and w.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and not cfg.bias_activation_fusion and not getattr(cfg, "use_te_activation_func", False)
            and getattr(cfg, "activation_func_clamp_value", None) is None
            and cfg.num_query_groups >= cfg.tensor_model_parallel_size)


class _PackedLinear:
    """A megatron linear layer's forward (no sequence parallelism) on its weight prepacked for oneDNN: returns
    (output, bias) as the module does (row-parallel: all-reduce over TP, then the bias unless skip_bias_add)."""

    def __init__(self, module, rows: int, weight=None, gather: bool = False):
        weight = module.weight if weight is None else weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        self.bias = module.bias
        self.skip_bias_add = module.skip_bias_add
        self.row_parallel = isinstance(module, RowParallelLinear)
        self.tp_group = module.tp_group
        self.gather = gather

    def __call__(self, x):
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), self.packed, None, "none", [], "")
        out = out.view(*x.shape[:-1], out.size(-1))
        if self.row_parallel:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        if self.gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class DecodeStep:
    """``step(x, mask, ctx)``: one decode forward of this stage. ``x``: token ids [B, 1] on the first stage, else
    the previous stage's hidden states [1, B, H]. ``mask``: megatron mask [B, 1, 1, sk] (True = masked) or None.
    Returns what ``GPTModel.forward`` returns: [B, 1, V] logits (gathered over TP) on the last stage, else hidden
    states [1, B, H] to send on."""

    def __init__(self, core, max_len: int, rows: int, packed: bool = True):
        self.core = core
        self.cfg = core.config
        self.freqs = core.rotary_pos_emb(max_len)  # [max_len, 1, 1, dim]: GPTModel's table for a static context
        self.mscale = _yarn_get_concentration_factor_from_config(self.cfg)
        self.output_weight = core.shared_embedding_or_output_weight() if (
            core.post_process and core.share_embeddings_and_output_weights) else None
        self.linears = packed_linears(core, rows, self.output_weight) if packed and onednn_packable(core) else None

    @torch.no_grad()
    def __call__(self, x, mask, ctx):
        core, pos = self.core, ctx.sequence_len_offset
        freqs = self.freqs[pos:pos + 1]
        h = core.embedding(input_ids=x, position_ids=None) if core.pre_process else x
        for layer in core.decoder.layers:
            h = self._layer(layer, h, freqs, mask, ctx, pos)
        if not core.post_process:
            return h
        if core.decoder.final_layernorm is not None:
            h = core.decoder.final_layernorm(h)
        if self.linears is not None:
            logits, _ = self.linears["output"](h)
        else:
            logits, _ = core.output_layer(h, weight=self.output_weight, runtime_gather_output=True)
        return logits.transpose(0, 1)

    def _layer(self, layer, h, freqs, mask, ctx, pos):
        att = layer.self_attention
        lin = self.linears[att.layer_number] if self.linears is not None else None
        x = layer.input_layernorm(h)
        q, k, v = att.get_query_key_value_tensors(x, None) if lin is None else _split_qkv(att, lin["qkv"](x)[0])
        cp = att.pg_collection.cp
        q = apply_rotary_pos_emb(q, freqs, config=self.cfg, mscale=self.mscale, cp_group=cp)
        k = apply_rotary_pos_emb(k, freqs, config=self.cfg, mscale=self.mscale, cp_group=cp)
        k_mem, v_mem = ctx.key_value_memory_dict[att.layer_number]
        b = k.size(1)
        k_mem[pos:pos + 1, :b] = k
        v_mem[pos:pos + 1, :b] = v
        ctx_out = att.core_attention(q, k_mem[:pos + 1, :b], v_mem[:pos + 1, :b], mask,
                                     attn_mask_type=AttnMaskType.no_mask)
        out_with_bias = att.linear_proj(ctx_out) if lin is None else lin["proj"](ctx_out)
        with layer.bias_dropout_add_exec_handler():
            h = layer.self_attn_bda(False, self.cfg.bias_dropout_fusion)(out_with_bias, h, layer.hidden_dropout)
        x = layer.pre_mlp_layernorm(h)
        out_with_bias = layer.mlp(x) if lin is None else _mlp(layer.mlp, lin, x)
        with layer.bias_dropout_add_exec_handler():
            h = layer.mlp_bda(False, self.cfg.bias_dropout_fusion)(out_with_bias, h, layer.hidden_dropout)
        return h


def packed_linears(core, rows: int, output_weight) -> dict:
    """{layer_number: {"qkv", "proj", "fc1", "fc2"}, "output": ...} prepacked for ``rows``-row inputs."""
    out = {}
    for layer in core.decoder.layers:
        att, mlp = layer.self_attention, layer.mlp
        out[att.layer_number] = {"qkv": _PackedLinear(att.linear_qkv, rows), "proj": _PackedLinear(att.linear_proj, rows),
                                 "fc1": _PackedLinear(mlp.linear_fc1, rows), "fc2": _PackedLinear(mlp.linear_fc2, rows)}
    if core.post_process:
        out["output"] = _PackedLinear(core.output_layer, rows, weight=output_weight, gather=True)
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
    """megatron's MLP.forward (unfused activation path, no clamp) with the prepacked fc1 / fc2."""
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
