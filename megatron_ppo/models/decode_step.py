"""A lean one-token decode forward over a megatron ``GPTModel`` stage: the same modules, without the scaffolding.

A decode step at 16 rows spends about half its CPU time outside the matmuls, much of it in the Python of
``GPTModel.forward`` -> ``TransformerBlock`` -> ``TransformerLayer`` -> ``Attention.forward`` (rotary tables rebuilt
each step, offload / recompute / fusion / nvtx branches, inference bookkeeping), 30 layers deep. This step calls the
same megatron modules and functions in the same order (norms, ``get_query_key_value_tensors``, megatron's
``apply_rotary_pos_emb``, our ``SDPACoreAttention``, ``linear_proj``, megatron's bias-dropout-add, ``mlp``, the
final norm and the output layer), so the logits are bit-identical to the full forward (tests/integration/
test_generation_decode_step.py), and tensor parallelism works through the modules' own collectives.

It writes each new key (RoPE-rotated, as ``CachedRopeSelfAttention`` stores the prompt's keys) and value into the
``StaticInferenceContext`` cache at column ``ctx.sequence_len_offset``; the caller advances the offset.

``unsupported_reason(core)`` lists what the step does not cover (MoE, MLA, cross-attention, gated attention output,
learned absolute positions, fused TP inference kernels, Transformer-Engine modules...); generation then takes
megatron's full forward.
"""
from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
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


class DecodeStep:
    """``step(x, mask, ctx)``: one decode forward of this stage. ``x``: token ids [B, 1] on the first stage, else
    the previous stage's hidden states [1, B, H]. ``mask``: megatron mask [B, 1, 1, sk] (True = masked) or None.
    Returns [B, V] logits (gathered over TP) on the last stage, else hidden states [1, B, H] to send on."""

    def __init__(self, core, max_len: int):
        self.core = core
        self.cfg = core.config
        self.freqs = core.rotary_pos_emb(max_len)  # [max_len, 1, 1, dim]: GPTModel's table for a static context
        self.mscale = _yarn_get_concentration_factor_from_config(self.cfg)
        self.output_weight = core.shared_embedding_or_output_weight() if (
            core.post_process and core.share_embeddings_and_output_weights) else None

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
        logits, _ = core.output_layer(h, weight=self.output_weight, runtime_gather_output=True)
        return logits[0]

    def _layer(self, layer, h, freqs, mask, ctx, pos):
        att = layer.self_attention
        x = layer.input_layernorm(h)
        q, k, v = att.get_query_key_value_tensors(x, None)
        cp = att.pg_collection.cp
        q = apply_rotary_pos_emb(q, freqs, config=self.cfg, mscale=self.mscale, cp_group=cp)
        k = apply_rotary_pos_emb(k, freqs, config=self.cfg, mscale=self.mscale, cp_group=cp)
        k_mem, v_mem = ctx.key_value_memory_dict[att.layer_number]
        b = k.size(1)
        k_mem[pos:pos + 1, :b] = k
        v_mem[pos:pos + 1, :b] = v
        ctx_out = att.core_attention(q, k_mem[:pos + 1, :b], v_mem[:pos + 1, :b], mask,
                                     attn_mask_type=AttnMaskType.no_mask)
        out_with_bias = att.linear_proj(ctx_out)
        with layer.bias_dropout_add_exec_handler():
            h = layer.self_attn_bda(False, self.cfg.bias_dropout_fusion)(out_with_bias, h, layer.hidden_dropout)
        x = layer.pre_mlp_layernorm(h)
        out_with_bias = layer.mlp(x)
        with layer.bias_dropout_add_exec_handler():
            h = layer.mlp_bda(False, self.cfg.bias_dropout_fusion)(out_with_bias, h, layer.hidden_dropout)
        return h
