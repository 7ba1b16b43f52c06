"""Reshardable model (and optimizer) checkpoints through megatron's dist_checkpointing, written atomically.

``save_checkpoint`` writes ``<dir>.tmp`` on all ranks, then rank 0 renames it to ``<dir>`` (an older ``<dir>``
is replaced only after the new one is complete). Any TP/PP layout can load what any other layout saved: the
sharded state dict maps every shard to its place in the global tensors. A small JSON sidecar records the
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
from megatron_ppo.models.heap import release_free_heap
from megatron_ppo.models.unwrap import unwrap_model

META_FILE = "megatron_ppo_model.json"
# The optimizer's dist_checkpointing format: "fully_reshardable" loads at any TP/PP/DP (Megatron's default for the
# distributed optimizer, fully_sharded_model_space, needs flattened ranges that 0.16.1's save refuses).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(model, directory: str, optimizer=None) -> None:
    """Save this rank's shards of ``model`` (and ``optimizer``) into ``directory`` (collective over all ranks)."""
    from megatron.core import dist_checkpointing, parallel_state

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
        _init_empty_adam_state(optimizer)  # never stepped (a save inside critic_warmup): Megatron asserts a step
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=OPTIMIZER_METADATA)
    release_free_heap()  # the save's copies start from the live state, not on top of the rank's last peak (heap.py)
    try:
        dist_checkpointing.save(state, tmp)
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
    state = {"model": core.sharded_state_dict()}
    if optimizer is not None:
        _init_empty_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True,
                                                          metadata=OPTIMIZER_METADATA)
    loaded = dist_checkpointing.load(state, directory)
    core.load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        with _keep_adam_step(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
    return meta


def _init_empty_adam_state(optimizer) -> None:
    """Give a fresh optimizer (no step taken) zero Adam state: before a load, which then overwrites it in place, and
    before a save of an optimizer that never stepped (the actor during trainer.critic_warmup).

    Megatron's distributed optimizer builds its sharded state dict from the existing state and asserts one common
    ``step`` (without Apex/TE): a never-stepped optimizer has none. A dummy optimizer step would do it but would
    also move the weights; zeros and step 0 are exactly a fresh Adam's state (torch Adam's first step from them
    equals its first step from no state). Parameters that already have state are left alone."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p].update(step=torch.zeros((), dtype=torch.float32),
                                          exp_avg=torch.zeros_like(p.data), exp_avg_sq=torch.zeros_like(p.data))


@contextlib.contextmanager
def _keep_adam_step(optimizer):
    """Work around megatron-core 0.16.1 loading a fully_reshardable distributed-optimizer state without TE/Apex:
    torch Adam keeps ``step`` in each parameter's state, the checkpoint keeps it in the param groups (restored by
    load_state_dict before), and ``_set_main_param_and_optimizer_states`` copies every state key from a source
    that has no ``step`` (KeyError). The step already restored is kept as it is."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None or getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            continue

        def with_step(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            step = opt.optimizer.state[main_param].get("step")
            if step is not None and "step" not in tensors:
                tensors = {**tensors, "step": step.clone()}
            return original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = with_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1's distributed-optimizer load (without TE/Apex) puts ONE ``step`` tensor into every
    parameter's Adam state; torch Adam increments each state's step in place, so the shared tensor would advance
    once per parameter per optimizer step and the bias correction of every later update would be wrong."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _is_value(role: str) -> bool:
    """A value-head model (critic, reward); checkpoints written before the role table named the reference
    "reference"."""
    from megatron_ppo import roles

    return roles.spec("ref" if role == "reference" else role).value_model
