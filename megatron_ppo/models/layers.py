"""Small modules the local spec needs: a sequence-parallel-aware norm and the scalar value head.

Both hold parameters replicated over tensor parallelism. Under sequence parallelism each TP rank sees only its
slice of the sequence, so their gradients are partial sums: the parameters are tagged ``.sequence_parallel = True``
and megatron's ``finalize_model_grads`` all-reduces them over TP. Without the tag training silently drifts.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_ppo.parallel.platform import default_device


def _tag_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    for param in module.parameters():
        param.sequence_parallel = bool(sequence_parallel)


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight (HF Llama/Qwen2 order), replicated over TP.
    ``F.rms_norm``: one fused kernel where torch has one (CUDA), where the spelled-out formula is eight."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        _tag_sequence_parallel(self, config.sequence_parallel)

    def forward(self, x):
        normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class LayerNorm(torch.nn.LayerNorm):
    """torch LayerNorm with megatron's constructor signature, replicated over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        _tag_sequence_parallel(self, config.sequence_parallel)


class Norm:
    """Megatron-style norm factory: ``Norm(config=..., hidden_size=..., eps=...)`` picks by config.normalization."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        if config.normalization == "LayerNorm":
            return LayerNorm(config, hidden_size, eps)
        raise ValueError(f"Norm: normalization={config.normalization!r} is not supported (RMSNorm, LayerNorm)")


class ValueHead(torch.nn.Module):
    """The critic / reward head that replaces GPTModel.output_layer: hidden [s, b, h] -> values [s, b, 1] (fp32).

    Replicated over TP (identical weights on all TP ranks: broadcast from TP rank 0 at init). With sequence
    parallelism the per-rank sequence slices are all-gathered, so every rank returns the full sequence.
    Call signature matches ColumnParallelLinear as GPTModel uses it: ``head(hidden, weight=None,
    runtime_gather_output=None) -> (values, None)``.
    """

    def __init__(self, config, hidden_size: int, bias: bool = False):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        device = default_device()  # (nccl broadcasts need the CUDA device)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device)) if bias else None
        with torch.no_grad():
            config.init_method(self.weight)
        _tag_sequence_parallel(self, config.sequence_parallel)
        self._sync_over_tp()

    def _sync_over_tp(self):
        if not torch.distributed.is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
            return
        group = parallel_state.get_tensor_model_parallel_group()
        src = torch.distributed.get_global_rank(group, 0)
        for param in self.parameters():
            torch.distributed.broadcast(param.data, src=src, group=group)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias).float()
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None
