"""Which of megatron's fused kernels a model turns on: Megatron-LM's training defaults wherever their library is
present on a GPU, nothing on the CPU (gloo runs keep the unfused path they were validated with).

* ``bias_activation_fusion`` / ``bias_dropout_fusion``: megatron's own ``jit_fuser`` (torch.compile) kernels, no
  extension needed; the activation fusion exists for gated SiLU (SwiGLU), gated GELU and biased GELU only.
* ``apply_rope_fusion``: Transformer Engine's fused RoPE (the TE spec; the local spec applies the per-token rotary
  table megatron_ppo gathers once per forward, models/gpt.py).
* ``gradient_accumulation_fusion``: the weight gradient GEMM accumulating straight into DDP's fp32 ``main_grad``;
  megatron's linears (the LM head in every spec) need apex's ``fused_weight_gradient_mlp_cuda`` for it.
* ``masked_softmax_fusion`` / ``persist_layer_norm`` stay off: SDPA and torch's norms replace them locally, TE
  brings its own.
"""
from __future__ import annotations

FUSION_KEYS = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
               "masked_softmax_fusion", "persist_layer_norm")


def grad_accum_fusion_available() -> bool:
    """apex's wgrad-accumulation extension imports (megatron's own probe, at its import)."""
    try:
        from megatron.core.tensor_parallel.layers import _grad_accum_fusion_available
    except ImportError:  # pragma: no cover - megatron moved it
        return False
    return bool(_grad_accum_fusion_available)


def activation_fusable(activation: str, gated: bool, bias: bool) -> bool:
    """megatron's MLP fuses SwiGLU, GeGLU and bias + GELU; anything else raises there."""
    return (activation == "swiglu") or (activation == "gelu" and (gated or bias))


def fusion_settings(impl: str, on_gpu: bool, activation: str, gated: bool, bias: bool,
                    grad_accum_available: bool) -> dict:
    """TransformerConfig fusion flags for a model on ``impl`` ('local' | 'transformer_engine')."""
    settings = dict.fromkeys(FUSION_KEYS, False)
    if not on_gpu:
        return settings
    settings["bias_activation_fusion"] = activation_fusable(activation, gated, bias)
    settings["bias_dropout_fusion"] = True
    settings["apply_rope_fusion"] = impl == "transformer_engine"
    settings["gradient_accumulation_fusion"] = grad_accum_available
    return settings
