"""Helpers for parity tests of the ops backends (tests/unit/test_ops_*.py and tools/gpu_check.sh).

A backend name is "reference" (torch, CPU tensors), "cpu" (CPU extension) or "cuda" (CUDA extension). Kernel
backends run under mode "kernels", so a missing extension fails the test instead of silently testing the fallback.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megatron_ppo.ops import _backend


def available_backends() -> list[str]:
    """Backends to test here: reference and cpu always (cpu fails loudly if unbuilt), cuda when a GPU is visible."""
    names = ["reference", "cpu"]
    if torch.cuda.is_available():
        names.append("cuda")
    return names


def kernel_backends() -> list[str]:
    return [name for name in available_backends() if name != "reference"]


@contextmanager
def use_backend(name: str) -> Iterator[torch.device]:
    """Run the block with ``name`` selected; yields the device the inputs must live on."""
    if name not in ("reference", "cpu", "cuda"):
        raise ValueError(f"backend must be reference, cpu or cuda, got {name!r}")
    previous = _backend.set_mode("reference" if name == "reference" else "kernels")
    try:
        yield torch.device("cuda" if name == "cuda" else "cpu")
    finally:
        _backend.set_mode(previous)
