"""Tensors between the driver's host memory and a worker's device.

The driver and everything it holds (rollout batches, advantages, metrics) live on the CPU; a worker's model may
live on a GPU. So a worker moves what it is given to its model's device before computing, and what it returns back
to the CPU: a result that stayed on the GPU would meet the driver's CPU tensors in the next operation (the first
GPU run of a PPO step stopped exactly there: ``response_lengths`` on cuda:0 against a CPU ``arange``).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["to_device", "to_host"]


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in it (dicts, lists, tuples, recursively) on ``device``; other values as they are.
    Tensors already there are returned as they are (no copy)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {key: to_device(value, device) for key, value in obj.items()}
    if isinstance(obj, list):
        return [to_device(value, device) for value in obj]
    if isinstance(obj, tuple):
        moved = [to_device(value, device) for value in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else tuple(moved)  # a namedtuple keeps its type
    return obj


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor in it on the CPU (see ``to_device``)."""
    return to_device(obj, "cpu")
