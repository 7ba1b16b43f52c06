"""fp32 GEMMs on CPU through oneDNN instead of MKL's sgemm: ``with onednn_matmul(): ...``.

Why: torch sends fp32 CPU matmuls to MKL (oneDNN only under reduced-precision modes, bf16/tf32). On some CPUs (the
AMD EPYC of our earlier CPU machines) MKL's sgemm runs a 135M model's shapes well below oneDNN's rate, in the
forward, input-gradient and weight-gradient GEMMs alike; on an Intel Xeon the two are close. Measured by
``tools/bench_cpu_matmul.py``: docs/bench/models.md (EPYC), docs/bench/peer.md (Xeon).

Inside the context, the aten ``mm`` and ``addmm`` calls on plain fp32 CPU tensors (what ``torch.matmul`` of a batch
by a 2-D weight and ``F.linear`` come down to) run on ``torch.ops.mkldnn._linear_pointwise``: megatron's linear layers
(forward ``x W^T``, input gradient ``dY W``, weight gradient ``dY^T X``, all inside megatron's own autograd Function,
so its tensor/sequence-parallel communication is untouched), the LM head, the critic's value head. A dispatch mode
sits below autograd, so gradients are recorded exactly as without it. Full fp32 arithmetic; results differ from MKL's
by summation order only (rounding level). Batched ``bmm`` (attention), other dtypes and devices pass through.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a tensor subclass with its own dispatch (fake, functional, DTensor)


def onednn_available() -> bool:
    """True when this torch build has oneDNN's fp32 linear op (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _plain_cpu_fp32(*tensors) -> bool:
    return all(type(t) in _PLAIN and t.dtype == torch.float32 and t.device.type == "cpu"
               and t.layout == torch.strided and t.numel() > 0 for t in tensors)


def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` for a [M, K], b [K, N] (any strides), bias [N], on oneDNN's fp32 linear."""
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


class _OneDNNMatmul(TorchDispatchMode):
    """Below autograd: sees the aten ``mm`` / ``addmm`` of forward and backward alike (autograd has already recorded
    what it needs at the ``mm`` level, and its backward's GEMMs come back through here)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten.mm.default:
            a, b = args
            if _plain_cpu_fp32(a, b):
                return onednn_mm(a, b)
        elif func is _aten.addmm.default:
            bias, a, b = args  # beta and alpha are keyword-only in aten's schema
            if (kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1 and _plain_cpu_fp32(a, b, bias)
                    and bias.dim() == 1 and bias.shape[0] == b.shape[1]):
                return onednn_mm(a, b, bias)
        return func(*args, **kwargs)


@contextlib.contextmanager
def onednn_matmul(enabled: bool = True):
    """Route the fp32 CPU GEMMs (aten ``mm`` / ``addmm``) of the enclosed code, forward and backward, through oneDNN;
    a no-op when disabled or when this torch has no oneDNN. Only fp32 CPU tensors are touched."""
    if not (enabled and onednn_available()):
        yield
        return
    with _OneDNNMatmul():
        yield
