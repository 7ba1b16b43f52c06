"""Transformer layer specs: Transformer-Engine when it imports, else megatron's local modules with SDPA attention.

fp32 models take the local spec even where TE imports: training micro-batches are packed THD, TE disables its
unfused attention backend for THD, and its flash / fused backends need fp16 or bf16, so TE would find no backend.

The local spec is megatron's ``get_gpt_layer_local_spec`` with two substitutions: core attention becomes
``SDPACoreAttention`` (THD, GQA, KV cache, flash/efficient SDPA kernels) and the norms become
``layers.Norm`` (fp32 RMSNorm that supports sequence parallelism by tagging its parameters).
"""
from __future__ import annotations

import copy
import functools
import logging

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_ppo.models.attention import CachedRopeSelfAttention, SDPACoreAttention
from megatron_ppo.models.layers import Norm

logger = logging.getLogger(__name__)

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@functools.lru_cache(maxsize=1)
def transformer_engine_available() -> bool:
    """True when Transformer Engine imports and megatron's TE spec can be built (never on CPU-only torch)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: F401
    except Exception as exc:  # ImportError, or TE failing to load its CUDA libraries
        logger.info("Transformer Engine unavailable (%s); using the local spec with SDPA attention", exc)
        return False
    return True


TE_DTYPES_NOTE = ("Transformer Engine has no attention backend for packed THD micro-batches in {dtype}: its unfused "
                  "backend is disabled for THD and its flash / fused backends need float16 or bfloat16")


def te_supports_dtype(params_dtype) -> bool:
    """TE's THD attention runs in fp16/bf16 only (see the module docstring); None: not known, assume yes."""
    import torch

    return params_dtype is None or params_dtype in (torch.float16, torch.bfloat16)


def resolve_transformer_impl(transformer_impl: str, params_dtype=None) -> str:
    """'auto': TE where it imports and the dtype has a TE attention backend for THD, else 'local'. An explicit
    'transformer_engine' that cannot run is refused with the reason."""
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={transformer_impl!r} not in {TRANSFORMER_IMPLS}")
    if transformer_impl == "auto":
        if not transformer_engine_available():
            return "local"
        if not te_supports_dtype(params_dtype):
            logger.info("%s: using the local spec with SDPA attention", TE_DTYPES_NOTE.format(dtype=params_dtype))
            return "local"
        return "transformer_engine"
    if transformer_impl == "transformer_engine" and not transformer_engine_available():
        raise RuntimeError("transformer_impl='transformer_engine' but Transformer Engine is not usable here")
    if transformer_impl == "transformer_engine" and not te_supports_dtype(params_dtype):
        raise ValueError(f"transformer_impl='transformer_engine' with params_dtype={params_dtype}: "
                         + TE_DTYPES_NOTE.format(dtype=params_dtype) + "; use bfloat16 or transformer_impl='local'")
    return transformer_impl


def local_layer_spec(normalization: str) -> ModuleSpec:
    """megatron's local GPT layer spec with SDPA core attention and SP-aware torch norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.submodules.input_layernorm = Norm
    spec.submodules.pre_mlp_layernorm = Norm
    spec.submodules.self_attention.module = CachedRopeSelfAttention
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def te_layer_spec() -> ModuleSpec:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def decoder_block_spec(config, transformer_impl: str, vp_stage=None):
    """The spec GPTModel takes: a layer spec for TE (megatron adds TENorm), explicit block submodules locally."""
    impl = resolve_transformer_impl(transformer_impl, config.params_dtype)
    if impl == "transformer_engine":
        return te_layer_spec()
    layer = local_layer_spec(config.normalization)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=Norm)
