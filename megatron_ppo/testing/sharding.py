"""Full (TP=1, PP=1) GPTModel state dicts <-> this rank's shard, from megatron's own parameter attributes.

A full state dict uses global layer numbers (``decoder.layers.{i}``) and the unsharded tensors of a TP=1 model.
Slicing follows what megatron records on each parameter: ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride`` (2 for the SwiGLU ``linear_fc1``, whose rank slice is [gate_r; up_r]). Vocab-sized tensors
are re-padded to this layout's padded vocab (``vocab_rows.repad_vocab``: the true vocab's rows are copied, the
padding rows are zero; a row count that is neither the true vocab nor a Megatron padding of it raises).

For tests and small models: the product moves weights through dist checkpoints (models/checkpoint.py,
megatron_ppo/convert/).
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megatron_ppo.models.unwrap import unwrap_model
from megatron_ppo.models.vocab_rows import repad_vocab

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def layer_offset(model) -> int:
    """Global index of this stage's first transformer layer."""
    layers = unwrap_model(model).decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def global_name(model, local_name: str) -> str:
    """Local parameter name -> name in the full model (layer index shifted by the pipeline offset)."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    return f"{m.group(1)}{int(m.group(2)) + layer_offset(model)}{m.group(3)}"


def _tp():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def shard_for_param(full: torch.Tensor, param: torch.Tensor, name: str = "", model=None) -> torch.Tensor:
    """This TP rank's slice of ``full`` for ``param`` (replicated params: ``full`` itself)."""
    if model is not None and any(name.endswith(v) for v in _VOCAB_PARAMS) and getattr(param, "tensor_model_parallel", False):
        core = unwrap_model(model)
        full = repad_vocab(full, name, core.arch, core.vocab_size)
    if not getattr(param, "tensor_model_parallel", False):
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"{name}: full shape {tuple(full.shape)} != replicated param {tuple(param.shape)}")
        return full
    rank, world = _tp()
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    if full.shape[dim] != param.shape[dim] * world:
        raise ValueError(f"{name}: full dim {dim} is {full.shape[dim]}, expected {param.shape[dim]} x TP {world}")
    pieces = torch.chunk(full, world * stride, dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


@torch.no_grad()
def load_full_state_dict(model, full: dict) -> None:
    """Load a full (TP1/PP1 names and shapes) state dict into this rank's stage. Missing keys raise."""
    core = unwrap_model(model)
    tied_out = core.post_process and core.share_embeddings_and_output_weights and not core.pre_process
    for name, param in core.named_parameters():
        key = global_name(core, name)
        if tied_out and key == "output_layer.weight":
            key = "embedding.word_embeddings.weight"
        if key not in full:
            raise KeyError(f"load_full_state_dict: {key} (local {name}) missing from the full state dict")
        param.copy_(shard_for_param(full[key].to(param.dtype), param, key, core))


def local_expected(model, full: dict) -> dict:
    """{local name: this rank's slice of full[global name]} — e.g. to compare sharded grads with TP1 grads."""
    core = unwrap_model(model)
    out = {}
    tied_out = core.post_process and core.share_embeddings_and_output_weights and not core.pre_process
    for name, param in core.named_parameters():
        key = global_name(core, name)
        if tied_out and key == "output_layer.weight":
            key = "embedding.word_embeddings.weight"
        if key in full:
            out[name] = shard_for_param(full[key], param, key, core)
    return out


@torch.no_grad()
def gather_full_state_dict(model, grads: bool = False) -> dict:
    """All-gather this model's shards (TP and PP) into a full TP1/PP1 state dict on every rank (small models).

    grads=True gathers ``main_grad`` (DDP) or ``.grad`` instead of the weights.
    """
    from megatron.core import parallel_state

    core = unwrap_model(model)
    rank, world = _tp()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    local = {}
    for name, param in core.named_parameters():
        key = global_name(core, name)
        if core.share_embeddings_and_output_weights and key == "output_layer.weight":
            continue
        t = param
        if grads:
            t = getattr(param, "main_grad", None)
            if t is None:
                t = param.grad
            if t is None:
                continue
        t = t.detach()
        if getattr(param, "tensor_model_parallel", False) and world > 1:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
            chunks = [torch.chunk(p, stride, dim=dim) for p in parts]
            t = torch.cat([chunks[r][s] for s in range(stride) for r in range(world)], dim=dim)
        local[key] = t.clone()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        everything = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(everything, local, group=pp_group)
        merged = {}
        for d in everything:
            merged.update(d)
        local = merged
    return local
