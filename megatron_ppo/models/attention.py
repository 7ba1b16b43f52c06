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

def varlen_usable(fn) -> bool:
    """True when torch's ``varlen_attn`` can run causal attention: a ``window_size`` (torch >= 2.11's spelling) or
    an ``is_causal`` keyword. ``scale`` and ``enable_gqa``, which older builds lack, are made up for
    (``varlen_arguments``)."""
    params = _parameters(fn)
    return params is not None and ("window_size" in params or "is_causal" in params)


def _parameters(fn):
    import inspect

    if fn is None:
        return None
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def varlen_arguments(params, q, k, v, scale: float):
    """(q, k, v, keyword arguments) for a causal ``varlen_attn`` call with this signature's keywords: without
    ``scale``, q is pre-scaled (the kernel's own scale is 1/sqrt(head_dim)); without ``enable_gqa``, K/V heads are
    repeated to the query heads."""
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kwargs["scale"] = scale
    else:
        q = q * (scale * math.sqrt(q.shape[-1]))
    if q.shape[-2] != k.shape[-2]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[-2] // k.shape[-2]
            k, v = k.repeat_interleave(repeat, dim=-2), v.repeat_interleave(repeat, dim=-2)
    return q, k, v, kwargs


try:  # torch >= 2.10: flash-attention varlen kernel (CUDA only)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    _varlen_attn = None
if _varlen_attn is not None and not varlen_usable(_varlen_attn):  # pragma: no cover - older torch
    logging.getLogger(__name__).info("torch %s's varlen_attn has no causal mode: packed THD attention on a GPU is "
                                     "padded SDPA", torch.__version__)
    _varlen_attn = None
_VARLEN_PARAMS = _parameters(_varlen_attn)

THD_STRATEGIES = ("auto", "varlen", "padded", "per_sequence", "block_mask", "flex")


def document_block_mask(segments: torch.Tensor):
    """FlexAttention's BlockMask for causal attention within each packed sequence (``segments``: each token's
    sequence), built once per micro-batch; on a GPU with ``torch.compile`` (what makes it cheap)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_sequence_causal(b, h, q_idx, kv_idx):
        return (segments[q_idx] == segments[kv_idx]) & (q_idx >= kv_idx)

    t = segments.numel()
    return create_block_mask(same_sequence_causal, None, None, t, t, device=segments.device,
                             _compile=segments.is_cuda)


_FLEX = {}


def flex_attention(q, k, v, block_mask, scale: float):
    """torch's FlexAttention on [1, heads, t, d]: compiled (triton) on a GPU, its unfused reference on the CPU."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if q.is_cuda:
        flex = _FLEX.setdefault("compiled", torch.compile(flex))
    return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.size(1) != k.size(1))


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
    """SDPA on [b, heads, s, d] with GQA and NaN-free fully-masked rows (their output is 0), reading nothing back.

    With a mask on a GPU, K/V heads are repeated instead of ``enable_gqa``: torch runs GQA only on its flash kernel
    (which takes no mask) and its math kernel (fp32 [b, heads, s, s] intermediates); repeated heads keep the
    memory-efficient kernel."""
    enable_gqa = q.size(-3) != k.size(-3)
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=enable_gqa)
    if enable_gqa and q.is_cuda:
        repeat = q.size(-3) // k.size(-3)
        k, v, enable_gqa = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3), False
    empty_rows = ~keep.any(dim=-1, keepdim=True)  # [..., sq, 1]
    keep = keep | empty_rows  # any finite softmax; the rows are zeroed below (no host read to ask whether any are)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, dropout_p=dropout_p,
                                         enable_gqa=enable_gqa)
    return out.masked_fill(empty_rows, 0.0)


class SDPACoreAttention(MegatronModule):
    """Megatron core-attention module backed by SDPA. q: [sq, b, np, hn]; k, v: [sk, b, ng, hn] -> [sq, b, np*hn].

    With ``packed_seq_params`` (qkv_format 'thd') q/k/v are [t, np|ng, hn] and the output is [t, np*hn].
    THD strategy (env ``MEGATRON_PPO_THD_ATTENTION`` or attribute ``thd_strategy``): 'varlen' (torch's flash
    varlen kernel: CUDA, fp16/bf16, no dropout), 'padded' (the sequences scattered into [n, max_s] rows, one causal
    SDPA call: flash / memory-efficient on a GPU), 'per_sequence' (one causal SDPA call per sequence),
    'block_mask' (one call with a block-diagonal mask: O(t^2)), 'flex' (FlexAttention with a document mask: one
    triton kernel on a GPU, compiled; on the CPU its unfused reference). 'auto': on a GPU varlen where it runs, else padded
    (never a loop over sequences there); on the CPU per_sequence (docs/bench/thd_attention.md measures the choice).
    With ``models.forward.PackedSequences`` (what ``model_forward`` builds for the local spec) nothing is read
    back from the device: the boundaries come as host ints, checked once per micro-batch where they were built.
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
        if self.thd_strategy in ("varlen", "flex") and p > 0:
            raise ValueError(f"SDPACoreAttention: the {self.thd_strategy} THD kernel has no attention dropout")
        if self.thd_strategy == "varlen" and _varlen_attn is None:
            raise ValueError(f"SDPACoreAttention: MEGATRON_PPO_THD_ATTENTION=varlen but torch {torch.__version__} has "
                             "no usable varlen_attn (torch.nn.attention.varlen with a causal mode)")
        if self.thd_strategy != "auto":
            return self.thd_strategy
        if not q.is_cuda:
            return "per_sequence"  # as fast as padded on the CPU, faster at small widths (bench_thd_attention)
        if _varlen_attn is not None and q.dtype in (torch.float16, torch.bfloat16) and p == 0:
            return "varlen"
        return "padded"

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
        from megatron_ppo.models.forward import PackedSequences

        t = query.shape[0]
        if isinstance(psp, PackedSequences):  # checked where it was built (models/forward.py): no read here
            cu, bounds, pad_index = psp.cu_seqlens, psp.bounds, psp.pad_index
        else:  # megatron's PackedSeqParams from another caller: checked here, reading cu_seqlens back
            cu, bounds, pad_index = self._check_megatron_params(psp, t), None, None
        if bounds is None:
            bounds = tuple(cu.tolist())
        if bounds[-1] != t:
            raise ValueError(f"SDPACoreAttention: cu_seqlens ends at {bounds[-1]} but the packed input has {t} "
                             "tokens")
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        max_s = max(lengths)
        strategy = self._pick_thd_strategy(query, p)
        if strategy == "varlen":
            q, k, v, kwargs = varlen_arguments(_VARLEN_PARAMS, query, key, value, self.softmax_scale)
            cu32 = cu.to(torch.int32)
            out = _varlen_attn(q, k, v, cu32, cu32, max_s, max_s, **kwargs)
            return out.reshape(t, self.hidden_size_per_partition)
        if strategy == "padded":
            if pad_index is None:
                from megatron_ppo.models.forward import packed_sequences

                pad_index = packed_sequences(cu, bounds).pad_index
            out = self._padded(query, key, value, pad_index, len(lengths), max_s, p)
            return out.reshape(t, self.hidden_size_per_partition)
        q = query.permute(1, 0, 2).unsqueeze(0)  # [1, np, t, hn]
        k = key.permute(1, 0, 2).unsqueeze(0)
        v = value.permute(1, 0, 2).unsqueeze(0)
        if strategy == "block_mask":
            keep = block_causal_keep_mask(cu, t)
            out = sdpa(q, k, v, keep=keep, scale=self.softmax_scale, dropout_p=p)
        elif strategy == "flex":
            if isinstance(psp, PackedSequences):
                if psp.block_mask is None:
                    psp.block_mask = document_block_mask(psp.segments)
                mask = psp.block_mask
            else:
                mask = document_block_mask(torch.searchsorted(cu[1:].long(), torch.arange(t, device=cu.device),
                                                              right=True))
            out = flex_attention(q, k, v, mask, self.softmax_scale)
        elif strategy == "per_sequence":
            # torch.split: one gradient buffer for all pieces (a slice's backward would zero-fill the whole packed
            # tensor once per sequence)
            pieces = [sdpa(qs, ks, vs, is_causal=True, scale=self.softmax_scale, dropout_p=p)
                      for qs, ks, vs, n in zip(q.split(lengths, dim=2), k.split(lengths, dim=2),
                                               v.split(lengths, dim=2), lengths) if n]
            out = torch.cat(pieces, dim=2)
        else:
            raise ValueError(f"SDPACoreAttention: unknown THD strategy {strategy!r}")
        return out.squeeze(0).permute(1, 0, 2).reshape(t, self.hidden_size_per_partition)

    def _padded(self, query, key, value, pad_index, n: int, max_s: int, p):
        """Packed [t, heads, d] -> rows [n, heads, max_s, d] (each sequence left-aligned, zeros after it), one causal
        SDPA call, back to packed. Causal attention never lets a real query see the zeros after its sequence."""

        def rows(x):
            padded = x.new_zeros(n * max_s, x.shape[1], x.shape[2]).index_copy(0, pad_index, x)
            return padded.view(n, max_s, x.shape[1], x.shape[2]).transpose(1, 2)

        out = sdpa(rows(query), rows(key), rows(value), is_causal=True, scale=self.softmax_scale, dropout_p=p)
        return out.transpose(1, 2).reshape(n * max_s, *query.shape[1:]).index_select(0, pad_index)

    @staticmethod
    def _check_megatron_params(psp, t: int) -> torch.Tensor:
        cu_q = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
        cu_k = psp.cu_seqlens_kv_padded if psp.cu_seqlens_kv_padded is not None else psp.cu_seqlens_kv
        if cu_q is None:
            raise ValueError("SDPACoreAttention: THD input needs packed_seq_params.cu_seqlens_q")
        if cu_k is not None and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
            raise ValueError("SDPACoreAttention: THD self-attention needs cu_seqlens_q == cu_seqlens_kv")
        return cu_q


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
