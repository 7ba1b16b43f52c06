"""Give a rank's freed heap memory back to the OS around a checkpoint save (models/checkpoint.save_checkpoint).

Why: torch frees a call's peak (a micro-batch's logits, activations), but glibc keeps freed pages in its arenas, and
tensors that only reference cycles hold wait for the garbage collector; a rank's resident size then stays near its
largest peak, and a save's own copies of the model and optimizer state come on top of it (until issue 47 a save
gathered every DP shard's optimizer state onto each rank; it now writes only the rank's own: docs/bench/checkpoint.md). On 2 cores and 24 GB a run was killed by Ray's memory monitor at a save (docs/bench/learning_smollm2.md).
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
from pathlib import Path
from typing import Callable


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


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().split()
        return int(text[0]) if text else None
    except (OSError, ValueError):  # absent, or cgroup v2's "max"
        return None


def _file_pages(stat: Path, keys: tuple[str, str]) -> int:
    try:
        fields = dict(line.split()[:2] for line in stat.read_text().splitlines() if len(line.split()) >= 2)
        return sum(int(fields.get(k, 0)) for k in keys)
    except (OSError, ValueError):
        return 0


# cgroup v2 (one hierarchy, "0::<path>") and v1 (the memory controller's line): the files of a limit, its usage, and
# the page-cache counters of memory.stat (hierarchical totals in v1)
_CGROUP_FILES = {"v2": ("memory.max", "memory.current", ("inactive_file", "active_file")),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "total_active_file"))}


def cgroup_available_fraction(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup",
                              host_total: int | None = None) -> float | None:
    """The tightest memory limit over this process's cgroup and its ancestors, as (limit - used) / limit, with used =
    usage minus page cache (reclaimable: the measure of Ray's memory monitor); None where no level has a limit below
    the host's memory.

    Why: under a cgroup limit (Slurm's --mem, a container) the kernel's OOM killer acts at the limit while the host
    can still look roomy, so the host's fraction alone would never trigger a release."""
    if host_total is None:
        import psutil

        host_total = psutil.virtual_memory().total
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    tightest = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and (Path(root) / "cgroup.controllers").is_file():
            kind, mount = "v2", Path(root)
        elif "memory" in controllers.split(","):
            kind, mount = "v1", Path(root) / "memory"
        else:
            continue
        limit_file, usage_file, cache_keys = _CGROUP_FILES[kind]
        levels = [mount / rel for rel in _ancestors(path)]
        for level in levels:  # a level outside this mount (a cgroup namespace) is absent and skipped
            limit, usage = _read_int(level / limit_file), _read_int(level / usage_file)
            if limit is None or usage is None or limit <= 0 or (host_total and limit >= host_total):
                continue
            used = max(0, usage - _file_pages(level / "memory.stat", cache_keys))
            fraction = max(0.0, (limit - used) / limit)
            tightest = fraction if tightest is None else min(tightest, fraction)
    return tightest


def _ancestors(path: str) -> list[str]:
    """'/a/b' -> ['a/b', 'a', ''] (relative to the mount, the process's own cgroup first)."""
    parts = [p for p in path.strip().split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def available_fraction() -> float:
    """The smaller of the host's available fraction and the tightest cgroup limit's (cgroup_available_fraction)."""
    import psutil

    vm = psutil.virtual_memory()  # read once: the host's fraction and the total that a cgroup limit is compared with
    host = vm.available / vm.total
    limited = cgroup_available_fraction(host_total=vm.total)
    return host if limited is None else min(host, limited)


def release_if_memory_short(min_available_fraction: float,
                            measure: Callable[[], float | None] = available_fraction) -> float | None:
    """Release the free heap (release_free_heap) when the available memory (``measure``: the host's, or a cgroup
    limit's where that is tighter) is under ``min_available_fraction``; the fraction seen when it released, else None
    (0 turns it off).

    Why: the roles colocated on a host take turns, and each rank keeps its largest peak's heap between its calls (a
    SmolLM2 GSM8K run: actor and critic ~8 GB each, ~3 GB of live state), so the idle roles' retained peaks and the
    busy role's new one add up until the host's OOM killer or Ray's memory monitor kills a rank (a run died at step 12
    at 22.45 of 23.54 GB). Releasing after every call costs page faults every time (the docstring above); releasing
    only when memory is short costs them only when the alternative is a dead rank."""
    if min_available_fraction <= 0:
        return None
    seen = measure()
    if seen is None or seen >= min_available_fraction:
        return None
    release_free_heap()
    return seen
