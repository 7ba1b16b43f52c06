"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` for the local (non-TE) layer spec.

A drop-in for megatron's ``DotProductAttention`` (same constructor and forward signature; it is plugged in as
``spec.submodules.self_attention.submodules.core_attention``) that adds what the local one lacks:

* packed THD input (``PackedSeqParams``, q/k/v ``[t, heads, dim]``) — megatron's local attention rejects it;
* SDPA kernels (flash / memory-efficient on GPU, fused math on CPU) instead of the unfused baddbmm + softmax;
* GQA without materialising repeated K/V (``enable_gqa``), KV-cached decode (``sq < sk``: bottom-right causal),
* rows whose keys are all masked (padding) give zeros, not NaN (SDPA's behaviour) — so no NaN reaches a gradient.

Mask convention: megatron masks are True = masked out; SDPA's boolean masks are True = keep.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

VARLEN_KWARGS = ("scale", "window_size", "enable_gqa")  # what the 'varlen' THD path passes


def varlen_usable(fn) -> bool:
    """True when torch's ``varlen_attn`` takes the keywords we pass (torch 2.13 does; 2.9's has no ``scale``,
    ``window_size`` or ``enable_gqa`` and would raise TypeError mid-forward)."""
    import inspect

    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(name in params for name in VARLEN_KWARGS)


try:  # torch >= 2.9: flash-attention varlen kernel (CUDA only)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    _varlen_attn = None
if _varlen_attn is not None and not varlen_usable(_varlen_attn):  # pragma: no cover - older torch
    logging.getLogger(__name__).info("torch %s's varlen_attn lacks %s: packed THD attention uses per-sequence "
                                     "SDPA", torch.__version__, "/".join(VARLEN_KWARGS))
    _varlen_attn = None

THD_STRATEGIES = ("auto", "varlen", "per_sequence", "block_mask")


def causal_keep_mask(sq: int, sk: int, device) -> torch.Tensor:
    """[sq, sk] bool, True = attend; queries are the last ``sq`` of ``sk`` positions (KV-cache aligned)."""
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    return k_pos <= q_pos


def block_causal_keep_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[t, t] bool: causal attention within each packed sequence (segments from ``cu_seqlens``), none across."""
    cu = cu_seqlens.to(torch.long)
    positions = torch.arange(total, device=cu.device)
    segment = torch.searchsorted(cu[1:], positions, right=True)
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    return same & (positions.unsqueeze(0) <= positions.unsqueeze(1))


def sdpa(q, k, v, keep=None, is_causal=False, scale=None, dropout_p=0.0):
    """SDPA on [b, heads, s, d] with GQA and NaN-free fully-masked rows (their output is 0)."""
    enable_gqa = q.size(-3) != k.size(-3)
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=enable_gqa)
    empty_rows = ~keep.any(dim=-1, keepdim=True)  # [..., sq, 1]
    has_empty = bool(empty_rows.any())
    if has_empty:
        keep = keep | empty_rows  # any finite softmax; the rows are zeroed below
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, dropout_p=dropout_p,
                                         enable_gqa=enable_gqa)
    if has_empty:
        out = out.masked_fill(empty_rows, 0.0)
    return out


class SDPACoreAttention(MegatronModule):
    """Megatron core-attention module backed by SDPA. q: [sq, b, np, hn]; k, v: [sk, b, ng, hn] -> [sq, b, np*hn].

    With ``packed_seq_params`` (qkv_format 'thd') q/k/v are [t, np|ng, hn] and the output is [t, np*hn].
    THD strategy (env ``MEGATRON_PPO_THD_ATTENTION`` or attribute ``thd_strategy``): 'varlen' (torch's flash
    varlen kernel: CUDA, fp16/bf16), 'per_sequence' (one causal SDPA call per sequence: O(sum s_i^2) memory),
    'block_mask' (one call with a block-diagonal mask: O(t^2)); 'auto' = varlen where it runs, else per_sequence.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention: context parallelism needs the Transformer-Engine spec")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPACoreAttention: softmax_type={config.softmax_type!r} is not supported")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPACoreAttention: sliding-window attention is not supported")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.hidden_size_per_partition = self.num_heads * self.head_dim
        # (apply_query_key_layer_scaling divides by layer_number and multiplies back inside megatron's softmax:
        # the net scale is unchanged, so it needs nothing here.)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.thd_strategy = os.environ.get("MEGATRON_PPO_THD_ATTENTION", "auto")
        if self.thd_strategy not in THD_STRATEGIES:
            raise ValueError(f"MEGATRON_PPO_THD_ATTENTION={self.thd_strategy!r} not in {THD_STRATEGIES}")

    # -- helpers --------------------------------------------------------------------------------------------
    def _dropout_ctx(self, p):
        if p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _pick_thd_strategy(self, q, p):
        if self.thd_strategy == "varlen" and p > 0:
            raise ValueError("SDPACoreAttention: the varlen THD kernel has no attention dropout")
        if self.thd_strategy == "varlen" and _varlen_attn is None:
            raise ValueError(f"SDPACoreAttention: MEGATRON_PPO_THD_ATTENTION=varlen but torch {torch.__version__} has "
                             f"no usable varlen_attn (it needs torch.nn.attention.varlen with {VARLEN_KWARGS})")
        if self.thd_strategy != "auto":
            return self.thd_strategy
        if _varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and p == 0:
            return "varlen"
        return "per_sequence"

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention: attention_bias is not supported")
        p = self.dropout_p if self.training else 0.0
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            with self._dropout_ctx(p):
                return self._forward_thd(query, key, value, packed_seq_params, p)
        if packed_seq_params is not None and packed_seq_params.qkv_format not in (None, "sbhd"):
            raise ValueError(f"SDPACoreAttention: qkv_format={packed_seq_params.qkv_format!r} not supported")

        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        keep, is_causal = None, False
        if attention_mask is not None:
            keep = ~attention_mask.to(torch.bool)
            if mask_type == AttnMaskType.padding_causal:
                keep = keep & causal_keep_mask(sq, sk, q.device)
        elif mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right):
            if sq == sk:
                is_causal = True
            elif sq > 1:
                keep = causal_keep_mask(sq, sk, q.device)
            # sq == 1 against a cache: the one query is the newest position and sees every key
        with self._dropout_ctx(p):
            out = sdpa(q, k, v, keep=keep, is_causal=is_causal, scale=self.softmax_scale, dropout_p=p)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _forward_thd(self, query, key, value, psp, p):
        t = query.shape[0]
        cu_q = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
        cu_k = psp.cu_seqlens_kv_padded if psp.cu_seqlens_kv_padded is not None else psp.cu_seqlens_kv
        if cu_q is None:
            raise ValueError("SDPACoreAttention: THD input needs packed_seq_params.cu_seqlens_q")
        if cu_k is not None and not torch.equal(cu_q, cu_k):
            raise ValueError("SDPACoreAttention: THD self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if int(cu_q[-1]) != t:
            raise ValueError(f"SDPACoreAttention: cu_seqlens ends at {int(cu_q[-1])} but the packed input has "
                             f"{t} tokens")
        strategy = self._pick_thd_strategy(query, p)
        if strategy == "varlen":
            max_s = psp.max_seqlen_q or int((cu_q[1:] - cu_q[:-1]).max())
            out = _varlen_attn(query, key, value, cu_q.to(torch.int32), cu_q.to(torch.int32), max_s, max_s,
                               scale=self.softmax_scale, window_size=(-1, 0),
                               enable_gqa=self.num_heads != self.num_groups)
            return out.reshape(t, self.hidden_size_per_partition)
        q = query.permute(1, 0, 2).unsqueeze(0)  # [1, np, t, hn]
        k = key.permute(1, 0, 2).unsqueeze(0)
        v = value.permute(1, 0, 2).unsqueeze(0)
        if strategy == "block_mask":
            keep = block_causal_keep_mask(cu_q, t)
            out = sdpa(q, k, v, keep=keep, scale=self.softmax_scale, dropout_p=p)
        elif strategy == "per_sequence":
            bounds = cu_q.tolist()
            pieces = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end > start:
                    pieces.append(sdpa(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True,
                                       scale=self.softmax_scale, dropout_p=p))
            out = torch.cat(pieces, dim=2)
        else:
            raise ValueError(f"SDPACoreAttention: unknown THD strategy {strategy!r}")
        return out.squeeze(0).permute(1, 0, 2).reshape(t, self.hidden_size_per_partition)


class CachedRopeSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` that stores RoPE-rotated keys in the static KV cache.

    megatron keeps un-rotated keys in ``StaticInferenceContext`` and rotates the whole cached key ``[:end]`` in every
    layer at every decode step (cos/sin/neg/cat/mul over the cache: a sizeable share of a small model's CPU decode
    step; measured in docs/bench/peer.md, "What session 3 changed", item 1).
    Here each key is rotated once, at its own position, before it is written, and the query at its positions; the
    values are the same elementwise products as megatron's (the same function on the same inputs), so the logits are
    bit-identical. Training, dynamic contexts, flash-decode and MLA take megatron's path unchanged.
    """

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb,
                                        rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                                        sequence_len_offset=None):
        plain = (inference_context is None or not inference_context.is_static_batching() or rotary_pos_emb is None
                 or self.config.flash_decode or getattr(self.config, "multi_latent_attention", False))
        if plain:
            return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                           rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                                           sequence_len_offset)
        q_pos_emb, k_pos_emb = rotary_pos_emb
        start = inference_context.sequence_len_offset
        end = start + key.size(0)
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        if q_pos_emb is not None:
            query = apply_rotary_pos_emb(query, q_pos_emb[start:end], config=self.config, mscale=mscale,
                                         cp_group=self.pg_collection.cp)
        if k_pos_emb is not None:
            key = apply_rotary_pos_emb(key, k_pos_emb[start:end], config=self.config, mscale=mscale,
                                       cp_group=self.pg_collection.cp)
        query, key, value, _, mask_type, block_table = super()._adjust_key_value_for_inference(
            inference_context, query, key, value, None, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
            sequence_len_offset)
        return query, key, value, None, mask_type, block_table  # None: the forward rotates nothing more
