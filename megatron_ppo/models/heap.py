"""Give a rank's freed heap memory back to the OS around a checkpoint save (models/checkpoint.save_checkpoint).

Why: torch frees a call's peak (a micro-batch's logits, activations), but glibc keeps freed pages in its arenas, and
tensors that only reference cycles hold wait for the garbage collector; a rank's resident size then stays near its
largest peak, and a save's own copies of the model and optimizer state (~4.5 GB on SmolLM2-135M in float32) come on
top of it. On 2 cores and 24 GB a run was killed by Ray's memory monitor at a save (docs/bench/learning_smollm2.md).
A garbage collection and ``malloc_trim(0)`` (glibc >= 2.8 also releases pages inside the heap, every arena) before
the save give back what is free then (a SmolLM2 probe, the actor rank: 8.89 -> 4.43 GB), and after it the save's
copies (4.96 -> 2.82 GB). The driver also has every other role's ranks release before a save
(RoleWorker.release_heap): on a shared host their retained peaks sat under the saving role's. Measured on the same
40-step SmolLM2 run (seed 2): the ranks gave back actor 3.65, critic 3.41, ref 0.64 GB, and the machine peaked at
14.8 GB during the save, against 23.84 GB for seed 1's save without the other roles' release.

Why only around saves and not after every call: giving pages back means faulting them in again, and faults are slow
on these VMs (5 GB of 20 MB tensors: 0.35 s retained vs 6.5-23 s fresh, measured beside a training run); a release
after every worker call made each update phase ~14 s slower on SmolLM2.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None  # not glibc (musl, macOS): nothing to do


def release_free_heap() -> bool:
    """Free what only reference cycles keep alive, then return the allocator's free pages to the OS; True where the
    C library could (glibc), False otherwise."""
    gc.collect()  # measured: without it the trim before a save released ~0.5 of ~4.4 GB (tensors held in cycles)
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


def host_available_fraction(meminfo: str = "/proc/meminfo") -> float | None:
    """MemAvailable / MemTotal of this host (Linux); None where the file or its fields are missing."""
    fields = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = rest.split()[0] if rest.split() else ""
        return int(fields["MemAvailable"]) / int(fields["MemTotal"])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def release_if_host_short(min_available_fraction: float, meminfo: str = "/proc/meminfo") -> float | None:
    """Release the free heap (release_free_heap) when the host's available memory is under ``min_available_fraction``
    of its total; the fraction seen when it released, else None (0 turns it off).

    Why: the roles colocated on a host take turns, and each rank keeps its largest peak's heap between its calls (a
    SmolLM2 GSM8K run: actor and critic ~8 GB each, ~3 GB of live state), so the idle roles' retained peaks and the
    busy role's new one add up until the host's OOM killer or Ray's memory monitor kills a rank (a run died at step 12
    at 22.45 of 23.54 GB). Releasing after every call costs page faults every time (the docstring above); releasing
    only when the host is short costs them only when the alternative is a dead rank."""
    if min_available_fraction <= 0:
        return None
    seen = host_available_fraction(meminfo)
    if seen is None or seen >= min_available_fraction:
        return None
    release_free_heap()
    return seen
