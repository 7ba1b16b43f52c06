"""Reshardable model (and optimizer) checkpoints through megatron's dist_checkpointing, written atomically.

``save_checkpoint`` writes ``<dir>.tmp`` on all ranks, then rank 0 renames it to ``<dir>`` (an older ``<dir>``
is replaced only after the new one is complete). Any TP/PP layout can load what any other layout saved: the
sharded state dict maps every shard to its place in the global tensors. A small JSON sidecar records the
architecture, role and layout at save time, so loading a checkpoint into the wrong model fails with a clear error.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from megatron_ppo.models.unwrap import unwrap_model

META_FILE = "megatron_ppo_model.json"


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
        state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    dist_checkpointing.save(state, tmp)
    if _rank() == 0:
        meta = {
            "role": getattr(core, "role", None),
            "arch": core.arch.to_dict() if hasattr(core, "arch") else None,
            "saved_layout": {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                             "pp": parallel_state.get_pipeline_model_parallel_world_size(),
                             "dp": parallel_state.get_data_parallel_world_size()},
            "has_optimizer": optimizer is not None,
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
    value_roles = ("critic", "reward")
    if meta.get("role") is not None and role is not None and (meta["role"] in value_roles) != (role in value_roles):
        raise ValueError(f"load_checkpoint: {directory} holds a {meta['role']} model, cannot load into a {role}")
    if meta.get("arch") is not None and hasattr(core, "arch"):
        saved = {k: v for k, v in meta["arch"].items() if k != "extra"}
        mine = {k: v for k, v in core.arch.to_dict().items() if k != "extra"}
        diff = {k: (saved.get(k), mine.get(k)) for k in set(saved) | set(mine) if saved.get(k) != mine.get(k)}
        if diff:
            raise ValueError(f"load_checkpoint: architecture of {directory} differs (saved, model): {diff}")
    if optimizer is not None and not meta.get("has_optimizer"):
        raise ValueError(f"load_checkpoint: {directory} has no optimizer state")
    state = {"model": core.sharded_state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True)
    loaded = dist_checkpointing.load(state, directory)
    core.load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    return meta
