"""Give a rank's freed heap memory back to the OS around a checkpoint save (models/checkpoint.save_checkpoint).

Why: torch frees a call's peak (a micro-batch's logits, activations), but glibc keeps the freed pages in its arenas,
so a rank's resident size stays at its largest peak, and the save's own copies of the model and optimizer state
(~4.8 GB on SmolLM2-135M in float32, ~2x the state) came on top of it instead of reusing it: on 2 cores and 24 GB
the actor rank went 7.4 -> 12.2 GB during its save while the critic held 6.8, and a run was killed by Ray's memory
monitor at its step-20 save (docs/bench/learning_smollm2.md). Before the save, a garbage collection frees the
tensors that only reference cycles keep (most of the ~4.4 GB above the live state was that), and ``malloc_trim(0)``
returns the free pages of every arena (glibc >= 2.8 also releases pages inside the heap), so the save starts from the
live state (~2.9 GB for the actor); after it, the save's copies go back too.

Why only there and not after every call: giving pages back means faulting them in again, and faults are slow on
these VMs (5 GB of 20 MB tensors: 0.35 s retained vs 6.5-23 s fresh, measured beside a training run); trimming after
every call made each update phase ~14 s slower on SmolLM2. A save happens every ``save_freq`` steps.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None  # not glibc (musl, macOS): nothing to do


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_heap() -> bool:
    """Free what only reference cycles keep alive, then return the allocator's free pages to the OS; True where the
    C library could (glibc), False otherwise."""
    gc.collect()  # measured: without it the trim before a save released ~0.5 of ~4.4 GB (tensors held in cycles)
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
