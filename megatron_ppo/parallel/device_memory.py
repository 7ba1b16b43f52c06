"""Giving a process's cached GPU memory back to the driver, for GPUs that several processes share.

PyTorch's caching allocator keeps the blocks a process freed for its own next allocations; another process on the
same GPU cannot use them. Colocated roles are separate processes (one layout per process), so without this each
keeps its largest phase's peak (the actor's logits or KV cache, the critic's activations) while the others run.
"""
from __future__ import annotations

import torch

__all__ = ["release_cached_memory"]


def release_cached_memory() -> int:
    """``torch.cuda.empty_cache()``; returns the bytes the allocator gave back (0 without CUDA, where the CPU
    platform layer's ``empty_cache`` is a no-op: parallel/platform.py). Tensors still alive keep their blocks."""
    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    before = torch.cuda.memory_reserved() if on_gpu else 0
    torch.cuda.empty_cache()
    return max(0, before - torch.cuda.memory_reserved()) if on_gpu else 0
