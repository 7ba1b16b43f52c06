"""torch.distributed + megatron parallel_state set-up and tear-down (TP, PP, DP; CP reserved).

``initialize()`` is the one call a worker makes before building Megatron models; ``destroy()`` undoes it so that a
process (a test, a worker switching layouts) can initialise again with another layout.
"""
from __future__ import annotations

import datetime
import gc
import logging
import os

import torch
import torch.distributed as dist

from megatron_ppo.parallel.platform import cpu_platform_needed, default_device, enable_cpu_platform

logger = logging.getLogger(__name__)

__all__ = [
    "initialize",
    "destroy",
    "is_initialized",
    "enable_cpu_platform",
    "default_device",
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "dp_rank",
    "dp_size",
    "is_first_stage",
    "is_last_stage",
    "seed_everything",
    "group_timeout_s",
    "process_group_timeout_s",
]

_owns_process_group = False
_initialized = False


def group_timeout_s(backend: str, timeout_s: float, nccl_timeout_s: float | None = None) -> float:
    """The timeout of every torch.distributed and Megatron group of a process on ``backend``.

    nccl: ``nccl_timeout_s`` (None: ``timeout_s``). NCCL's watchdog aborts the process when a collective outlasts
    the group timeout, and a synchronous checkpoint save or load of tens of GB per rank keeps the ranks that finished
    first waiting in a collective for minutes; Megatron's gloo twins of the DP groups (its distributed-optimizer
    checkpoints gather through them) wait as long, so they get the same. gloo (CPU, no NCCL): ``timeout_s``, the
    fail-fast backstop (cluster.collective_timeout_s): there the timeout is what ends a collective whose live peer
    never joins it, so it stays short; a CPU config that saves for longer raises it (smollm2_gsm8k.yaml: 600 s)."""
    if backend == "nccl" and nccl_timeout_s is not None:
        return float(nccl_timeout_s)
    return float(timeout_s)


def process_group_timeout_s(group=None) -> float:
    """The timeout ``group`` (default: the world) was created with, read back from its backend (diagnostics, tests)."""
    from torch.distributed import distributed_c10d as c10d

    pg = group or c10d._get_default_group()
    device = torch.device("cuda") if dist.get_backend(pg) == "nccl" else torch.device("cpu")
    return pg._get_backend(device).options._timeout.total_seconds()


def _init_process_group(backend: str, timeout_s: float) -> None:
    global _owns_process_group
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise RuntimeError(f"parallel.initialize: WORLD_SIZE is set but env var {key} is missing")
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    else:
        # A single process: an in-memory store, no ports.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    _owns_process_group = True


def seed_everything(seed: int) -> None:
    """Seed python-side torch RNGs and Megatron's model-parallel RNG tracker (CPU tracker on CPU)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)  # resets the tracker in place (keeps the object)


def initialize(
    tp: int = 1,
    pp: int = 1,
    seed: int = 1234,
    backend: str | None = None,
    *,
    cp: int = 1,
    timeout_s: float = 1800.0,
    nccl_timeout_s: float | None = None,
) -> None:
    """Initialise torch.distributed (if needed), Megatron's parallel_state and the RNG tracker.

    backend: None picks nccl when CUDA is available, else gloo (with the CPU platform layer).
    timeout_s / nccl_timeout_s: the groups' timeout on gloo / on nccl (``group_timeout_s``; None: timeout_s).
    World size comes from the torchrun-style env (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT); without it the
    process is a world of one. An already-initialised process group is reused (and then not destroyed by destroy()).
    """
    global _initialized
    from megatron.core import parallel_state

    if _initialized or parallel_state.model_parallel_is_initialized():
        raise RuntimeError("parallel.initialize: already initialised; call parallel.destroy() first")
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.initialize: {name} must be a positive int, got {value!r}")
    if cp != 1:
        raise NotImplementedError("parallel.initialize: context parallelism (cp>1) is reserved, not supported yet")

    on_cpu = cpu_platform_needed()
    if on_cpu:
        enable_cpu_platform()
    if backend is None:
        backend = "gloo" if on_cpu else "nccl"
    if backend == "nccl" and on_cpu:
        raise ValueError("parallel.initialize: backend='nccl' needs CUDA; this torch has none (use gloo)")

    if not on_cpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    timeout = group_timeout_s(backend, timeout_s, nccl_timeout_s)
    if not dist.is_initialized():
        _init_process_group(backend, timeout)

    world = dist.get_world_size()
    if world % (tp * pp) != 0:
        raise ValueError(
            f"parallel.initialize: world size {world} is not divisible by tp*pp = {tp}*{pp} (rank {dist.get_rank()})"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        distributed_timeout_minutes=timeout / 60.0,  # a float works: megatron makes it a timedelta
    )
    seed_everything(seed)
    _initialized = True
    logger.debug("parallel.initialize: rank %d/%d tp=%d pp=%d dp=%d, %s groups time out after %.0f s",
                 dist.get_rank(), world, tp, pp, dp_size(), backend, timeout)


def destroy(destroy_process_group: bool = True) -> None:
    """Tear down Megatron's parallel state (and the process group if initialize() created it).

    destroy_process_group=False keeps torch.distributed up, so the same ranks can initialise another layout.
    """
    global _initialized, _owns_process_group
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if dist.is_initialized() and not (destroy_process_group and _owns_process_group):
        _destroy_subgroups()  # megatron's destroy_model_parallel only forgets them
    parallel_state.destroy_model_parallel()
    mrandom.initialize_rng_tracker(force_reset=True)
    _destroy_global_caches()
    if destroy_process_group and _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()  # every group
        _owns_process_group = False
    _initialized = False


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one. Megatron creates ~20 (TP, PP, DP, their gloo twins, ...);
    each gloo group keeps its own threads, so re-initialising a layout on a live world (a worker pool running one
    layout per job) without this leaked dozens of polling threads per layout, which over a full test run added up
    to thousands of threads busy on the CPU."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    for group in list(c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


def _destroy_global_caches() -> None:
    """Megatron keeps a few module-level caches keyed by model or group; drop the ones that outlive a layout.
    RoPE's tables sit in a class-wide ``lru_cache`` keyed by the module itself, which kept up to 32 modules (and
    their context-parallel groups) of models long gone; parallel_state keeps its intra-partial DP groups past
    ``destroy_model_parallel``. Then a collection: a model dropped by its owner stays in reference cycles
    (DDP's gradient hooks on the parameters' autograd nodes close over the DDP) until the collector runs, and
    with it the process groups it holds and their gloo threads."""
    try:
        from megatron.core.transformer import utils as tutils

        tutils._sequence_parallel_attr_cache = None
    except (ImportError, AttributeError):
        pass
    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        RotaryEmbedding.forward.cache_clear()
    except (ImportError, AttributeError):
        pass
    from megatron.core import parallel_state

    for name in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO"):
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)
    gc.collect()


def is_initialized() -> bool:
    return _initialized


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def tp_rank() -> int:
    return _ps().get_tensor_model_parallel_rank()


def tp_size() -> int:
    return _ps().get_tensor_model_parallel_world_size()


def pp_rank() -> int:
    return _ps().get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return _ps().get_pipeline_model_parallel_world_size()


def dp_rank() -> int:
    return _ps().get_data_parallel_rank()


def dp_size() -> int:
    return _ps().get_data_parallel_world_size()


def is_first_stage() -> bool:
    return _ps().is_pipeline_first_stage(ignore_virtual=True)


def is_last_stage() -> bool:
    return _ps().is_pipeline_last_stage(ignore_virtual=True)


# ---------------------------------------------------------------------------------------------- collectives the
# workers agree with: every rank of a role takes the same decision from the same reduced values

def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def layout() -> dict:
    """This rank's layout, as checkpoints record it (RNG states are restored only at the saving layout)."""
    return {"tp": tp_size(), "pp": pp_size(), "dp": dp_size(), "world": world_size()}


def dp_group():
    return _ps().get_data_parallel_group(with_context_parallel=True)


def all_reduce(t: torch.Tensor, group, op=None) -> torch.Tensor:
    """Sum (or ``op``) of a CPU tensor over ``group``, through the device the backend needs; back on the CPU."""
    dev = t.to(default_device())
    dist.all_reduce(dev, op=op or dist.ReduceOp.SUM, group=group)
    return dev.cpu()


def dp_sum(values: list[float]) -> list[float]:
    """``values`` summed over the data-parallel replicas (float64)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dp_size() > 1:
        t = all_reduce(t, dp_group())
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on any rank of this model's replicas (model-parallel x data-parallel),
    so that all ranks skip or step together (the loss lives only on the last pipeline stage)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([float(flag)])
    t = all_reduce(t, _ps().get_model_parallel_group(), dist.ReduceOp.MAX)
    t = all_reduce(t, dp_group(), dist.ReduceOp.MAX)
    return bool(t.item() > 0)
