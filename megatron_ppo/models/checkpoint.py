"""Reshardable model (and optimizer) checkpoints through megatron's dist_checkpointing, written atomically.

``save_checkpoint`` writes ``<dir>.tmp`` on all ranks, then rank 0 renames it to ``<dir>`` (an older ``<dir>``
is replaced only after the new one is complete). Any TP/PP/DP layout can load what any other layout saved: the
sharded state dict maps every shard to its place in the global tensors. The distributed optimizer's state is
written and read per DP shard (models/optimizer_state.py): no rank holds another rank's shard during a save or load. A small JSON sidecar records the
architecture, role and layout at save time, so loading a checkpoint into the wrong model fails with a clear error,
and the megatron-core version that wrote it: an older megatron-core refuses a checkpoint it cannot read, naming both
versions (compat/mcore.py), instead of failing deep inside dist_checkpointing.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch
import torch.distributed as dist

from megatron_ppo.compat import mcore as mcore_compat
from megatron_ppo.models import optimizer_state
from megatron_ppo.models.heap import release_free_heap
from megatron_ppo.models.unwrap import unwrap_model

META_FILE = "megatron_ppo_model.json"
# The optimizer's dist_checkpointing format: megatron's "fully_reshardable" tensors, which load at any TP/PP/DP; the
# distributed optimizer writes and reads them per DP shard (models/optimizer_state.py) instead of megatron's gather of
# the whole DP group's state onto every rank. Megatron's default for the distributed optimizer,
# fully_sharded_model_space, needs flattened ranges that 0.16.1's save refuses; dp_reshardable loads only at the
# saving TP/PP (docs/bench/checkpoint.md compares them).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# The inner optimizers whose state megatron-core's checkpoints hold (Adam's exp_avg and exp_avg_sq, the step), by
# class: torch's (what megatron builds without TE or apex; AdamW with decoupled weight decay, its default) and the
# fused ones it picks when TE or apex import (untested here: no GPU; docs/trainer.md). megatron's SGD has no state
# initialiser for a load and its distributed optimizer reads Adam's keys: refused by name.
SUPPORTED_OPTIMIZERS = ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW",
                        "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam",
                        "apex.optimizers.fused_adam.FusedAdam")
# torch's Adam and AdamW keep `step` in each parameter's state (megatron reads one common step from there); the
# fused ones keep it in the param groups
PER_PARAMETER_STEP = ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(model, directory: str, optimizer=None) -> None:
    """Save this rank's shards of ``model`` (and ``optimizer``) into ``directory`` (collective over all ranks)."""
    from megatron.core import dist_checkpointing, parallel_state

    if optimizer is not None:
        check_optimizer(optimizer, "save_checkpoint")
    core = unwrap_model(model)
    directory = os.path.abspath(directory)
    tmp = directory + ".tmp"
    if _rank() == 0:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    state = {"model": core.sharded_state_dict()}
    if optimizer is not None:
        init_fresh_state(optimizer)  # never stepped (a save inside critic_warmup): Megatron asserts a step
        with optimizer_state.per_shard(optimizer):
            state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=OPTIMIZER_METADATA)
    release_free_heap()  # the save's copies start from the live state, not on top of the rank's last peak (heap.py)
    try:
        dist_checkpointing.save(state, tmp, _save_strategy())
    finally:
        del state
        release_free_heap()
    if _rank() == 0:
        meta = {
            "role": getattr(core, "role", None),
            "arch": core.arch.to_dict() if hasattr(core, "arch") else None,
            "saved_layout": {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                             "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                             "dp": parallel_state.get_data_parallel_world_size()},
            "has_optimizer": optimizer is not None,
            "megatron_core": mcore_compat.version(),
        }
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        old = directory + ".old"
        if os.path.exists(directory):
            os.rename(directory, old)
        os.rename(tmp, directory)
        if os.path.exists(old):
            shutil.rmtree(old)
    _barrier()


def read_checkpoint_meta(directory: str) -> dict:
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} is not a megatron_ppo model checkpoint (no {META_FILE})")
    with open(path) as f:
        return json.load(f)


def load_checkpoint(model, directory: str, optimizer=None) -> dict:
    """Load ``directory`` into ``model`` (and ``optimizer``) at the current layout; returns the checkpoint meta."""
    from megatron.core import dist_checkpointing

    core = unwrap_model(model)
    meta = read_checkpoint_meta(directory)
    role = getattr(core, "role", None)
    if meta.get("role") is not None and role is not None and _is_value(meta["role"]) != _is_value(role):
        raise ValueError(f"load_checkpoint: {directory} holds a {meta['role']} model, cannot load into a {role}")
    if meta.get("arch") is not None and hasattr(core, "arch"):
        saved = {k: v for k, v in meta["arch"].items() if k != "extra"}
        mine = {k: v for k, v in core.arch.to_dict().items() if k != "extra"}
        diff = {k: (saved.get(k), mine.get(k)) for k in set(saved) | set(mine) if saved.get(k) != mine.get(k)}
        if diff:
            raise ValueError(f"load_checkpoint: architecture of {directory} differs (saved, model): {diff}")
    if optimizer is not None and not meta.get("has_optimizer"):
        raise ValueError(f"load_checkpoint: {directory} has no optimizer state")
    mcore_compat.check_readable(directory, meta.get("megatron_core"))
    if optimizer is not None:
        check_optimizer(optimizer, "load_checkpoint")
        init_fresh_state(optimizer)  # megatron's load reads the state's keys (and torch Adam's step) before loading
    with optimizer_state.per_shard(optimizer) if optimizer is not None else contextlib.nullcontext():
        state = {"model": core.sharded_state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True,
                                                              metadata=OPTIMIZER_METADATA)
        loaded = dist_checkpointing.load(state, directory)
        core.load_state_dict(loaded["model"], strict=True)
        if optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
    if optimizer is not None:
        unshare_state_tensors(optimizer)
    return meta


def _save_strategy():
    """With DP > 1 the replicated tensors (the model's weights, a non-distributed optimizer's state) are written by
    all DP ranks, each a part, instead of all by DP rank 0 (megatron's fully parallel save: it only decides who
    writes what; the files are the same). On a GPU every written byte passes through host memory first."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
        return None
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def _inner_optimizers(optimizer) -> list:
    """(megatron optimizer, its torch optimizer) for each optimizer of a chain."""
    return [(o, o.optimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if getattr(o, "optimizer", None) is not None]


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_optimizer(optimizer, where: str) -> None:
    """Refuse, before anything is read or written, an optimizer whose state megatron-core cannot checkpoint."""
    for _, inner in _inner_optimizers(optimizer):
        if _class_name(inner) not in SUPPORTED_OPTIMIZERS:
            raise ValueError(f"{where}: optimizer {_class_name(inner)} (rank {_rank()}) cannot be checkpointed: "
                             "megatron-core's optimizer checkpoints hold Adam's state (exp_avg, exp_avg_sq, step); "
                             f"supported: {', '.join(SUPPORTED_OPTIMIZERS)}")


def init_fresh_state(optimizer) -> None:
    """Give the parameters of an optimizer that has not stepped the state its first step would create: before a
    load, which then overwrites it in place, and before a save of an optimizer that never stepped (the actor during
    trainer.critic_warmup).

    megatron reads the state's keys to build the sharded state dict, and without TE/apex asserts one common ``step``
    in the parameters' states; a never-stepped optimizer has none. A dummy optimizer step would also move the
    weights. The optimizer's own initialiser (megatron's ``init_state_fn``: zero moments, or TE's
    ``initialize_state`` for its precision-aware FusedAdam) makes the moments; torch's Adam and AdamW also get a
    per-parameter step 0 (their first step from it equals their first step from no state). Parameters that already
    have state are left alone."""
    for opt, inner in _inner_optimizers(optimizer):
        empty = [p for group in inner.param_groups for p in group["params"] if len(inner.state[p]) == 0]
        if not empty:
            continue
        opt.init_state_fn(inner, opt.config)
        if _class_name(inner) in PER_PARAMETER_STEP:
            for p in empty:
                inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


def unshare_state_tensors(optimizer) -> None:
    """megatron-core's distributed-optimizer load (without TE/apex) puts ONE ``step`` tensor into every
    parameter's state; torch Adam increments each state's step in place, so a shared tensor would advance once per
    parameter per optimizer step and the bias correction of every later update would be wrong. Any tensor found in
    more than one parameter's state gets a copy of its own."""
    for _, inner in _inner_optimizers(optimizer):
        seen = set()
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    if id(value) in seen:
                        state[key] = value.clone()
                    else:
                        seen.add(id(value))


def _is_value(role: str) -> bool:
    """A value-head model (critic, reward); checkpoints written before the role table named the reference
    "reference"."""
    from megatron_ppo import roles

    return roles.spec("ref" if role == "reference" else role).value_model
