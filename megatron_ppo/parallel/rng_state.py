"""Every RNG of this process that can affect a run, as plain tensors/ints, and back: python's ``random``, numpy's
legacy global generator, torch's CPU generator, CUDA's generators (when CUDA is in use) and Megatron's RNG tracker
(the model-parallel dropout streams; on CPU our tracker in parallel/platform.py keeps CPU generator states).

The captured dict holds only tensors, ints, floats, strings, None and lists/tuples/dicts of those, so a checkpoint
reads it back with ``torch.load(weights_only=True)`` (no pickle of arbitrary objects).
"""
from __future__ import annotations

import random

import numpy as np
import torch


def _cuda_in_use() -> bool:
    from megatron_ppo.parallel.platform import cpu_platform_enabled

    return torch.cuda.is_available() and not cpu_platform_enabled()


def capture_rng() -> dict:
    """This process's RNG states (see the module docstring)."""
    from megatron.core import tensor_parallel

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if _cuda_in_use() else None,
        "tracker": {name: state.clone() for name, state in tracker.get_states().items()},
    }


def restore_rng(state: dict) -> None:
    """Put back what capture_rng returned (in the same kind of process: CUDA states only where CUDA is in use)."""
    from megatron.core import tensor_parallel

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and _cuda_in_use():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if state["tracker"]:
        tracker.set_states({name: s.clone() for name, s in state["tracker"].items()})
