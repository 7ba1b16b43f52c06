"""The distributed optimizer's state in a checkpoint: megatron-core's ``fully_reshardable`` tensors, each DP rank
writing and reading only its own shard.

megatron-core's fully_reshardable save all-gathers every DP rank's shard of the fp32 main params, exp_avg and
exp_avg_sq onto every DP rank (its memory-efficient variant: onto DP rank 0), then cuts the whole buffers into one
model-space tensor per parameter and key (``optimizer.state.<key>.<model key>``); its load reads each parameter's
whole TP-local state on every DP rank and trims. Either way one rank holds its DP group's whole state: DP x its own
shard on the host (5x at SmolLM2 DP2, ~26 GB a rank at 70B: docs/bench/checkpoint.md). dp_reshardable gathers
nothing but loads only at the saving TP/PP.

Here the same model-space tensors are written as boxes: a parameter's DP range ``[start, end)`` of its flattened
TP-local tensor is, in row-major order, at most 2 x ndim - 1 boxes (a partial first row, whole rows, a partial last
row, recursively), each a ShardedTensor at its own global offset (uneven sharding: torch DCP checks at the save that
the boxes cover every tensor once). The load asks for the same boxes of the checkpoint's tensors, whichever way they
were cut when written. So the files hold what megatron's gather writes, element for element
(tests/integration/test_models_checkpoint.py compares them), and old (gathered) checkpoints and new ones
load either way, at any TP/PP/DP. Keys come from the optimizer's own state (megatron's
``_get_main_param_and_optimizer_states``, which also covers TE's precision-aware FusedAdam); 0-dim entries (torch
Adam's per-parameter ``step``) stay out, as in megatron: the step is saved in the param groups.
"""
from __future__ import annotations

import contextlib
import math

import torch

STATE_PREFIX = "optimizer.state"  # megatron's fully_reshardable key prefix


def row_major_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements ``[start, stop)`` of a row-major array of ``shape`` as boxes ``(offset, size)``, in memory order:
    each box is contiguous in the flat array (only its first axis may be partial)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    head, tail = start - first * inner, stop - last * inner  # tail in (0, inner]

    def row(r, lo, hi):
        return [((r, *o), (1, *s)) for o, s in row_major_boxes(shape[1:], lo, hi)]

    if first == last:
        return row(first, head, tail)
    boxes = row(first, head, inner) if head else []
    whole_from, whole_to = first + (1 if head else 0), last + (1 if tail == inner else 0)
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from, *shape[1:])))
    return boxes + (row(last, 0, tail) if tail < inner else [])


def _flat_index(shape: tuple[int, ...], offset: tuple[int, ...]) -> int:
    index = 0
    for size, o in zip(shape, offset):
        index = index * size + o
    return index


def _model_space_parts(sharded, key: str, replica_id):
    """``[(ShardedTensor, its first element in the flattened TP-local parameter)]`` under ``key``, in flat order.
    A factory (SwiGLU's fc1: its gate and up halves are separate global tensors) is built on a meta tensor: the
    storage offset of each part's view says where in the parameter it starts."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if not isinstance(sharded, ShardedTensorFactory):
        return [(sharded, 0)]
    meta = torch.empty(tuple(sharded.data.shape), device="meta")
    parts = list(nested_values(sharded.build_fn(key, meta, replica_id, None)))
    spans = sorted((p.data.storage_offset(), p.data.numel()) for p in parts
                   if isinstance(p, ShardedTensor) and p.data.is_contiguous())
    covered = len(spans) == len(parts) and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if not covered or spans[0][0] != 0 or spans[-1][0] + spans[-1][1] != meta.numel():
        raise NotImplementedError(f"optimizer checkpoint: the sharded-state factory of {sharded.key} does not cut "
                                  "its parameter into contiguous parts; its optimizer state cannot be saved per shard")
    return sorted(((p, p.data.storage_offset()) for p in parts), key=lambda pb: pb[1])


def _boxes(sharded, key: str, flat: torch.Tensor, start: int, replica_id) -> list:
    """ShardedTensors (views of ``flat``) putting ``flat`` = elements ``[start, start + numel)`` of the flattened
    TP-local parameter that ``sharded`` (the model's ShardedTensor or factory) describes into model space."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stop = start + flat.numel()
    out = []
    for part, base in _model_space_parts(sharded, key, replica_id):
        shape = tuple(part.local_shape)
        lo, hi = max(start, base), min(stop, base + math.prod(shape))
        lead = (1,) * part.prepend_axis_num
        for offset, size in row_major_boxes(shape, lo - base, hi - base):
            first = base + _flat_index(shape, offset) - start
            data = flat[first:first + math.prod(size)].view(lead + size)
            global_offset = (tuple(part.global_offset[:part.prepend_axis_num])
                             + tuple(g + o for g, o in zip(part.global_offset[part.prepend_axis_num:], offset)))
            out.append(ShardedTensor(key, data, data.dtype, lead + size, tuple(part.global_shape), global_offset,
                                     None, replica_id, 0, part.allow_shape_mismatch))
    return out


def _shard_params(opt, model_sharded_state_dict) -> list:
    """``[(model param, its model ShardedTensor or factory, start of this DP rank's range)]``, in megatron's order."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {id(sh.data): sh for sh in nested_values(tensors)}
    out = []
    for gbuf_range_maps in opt.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for model_param, ranges in bucket["param_map"].items():
                    sharded = by_param.get(id(model_param))
                    if sharded is None:
                        raise ValueError(f"optimizer checkpoint: a parameter of shape {tuple(model_param.shape)} is "
                                         "not in the model's sharded state dict")
                    out.append((model_param, sharded, ranges["param"].start))
    return out


def _replica_id(opt, sharded):
    """The model tensor's replica id with its DP coordinate set to the optimizer instance: every DP rank writes its
    own part; TP/PP replicas (norms over TP, the tied output layer on the last stage) stay non-main as for the
    model."""
    rid = sharded.replica_id
    if not (isinstance(rid, tuple) and len(rid) == 3):
        raise ValueError(f"optimizer checkpoint: {sharded.key} has replica_id {rid!r}, expected (PP, TP, DP)")
    return (*rid[:2], opt.distributed_optimizer_instance_id)


def _state_tensors(opt, model_param) -> dict:
    """The optimizer's own per-parameter tensors for this rank's shard (main param as ``param``), 0-dim ones out."""
    return {k: v for k, v in opt._get_main_param_and_optimizer_states(model_param).items()
            if isinstance(v, torch.Tensor) and v.dim() > 0}


class _PerShard:
    """Replaces one DistributedOptimizer's fully_reshardable builders (save and load) while active."""

    def __init__(self, opt):
        self.opt = opt
        self.requests = []  # load: (model param, {key: flat buffer}, {key: [views]})

    def sharded_param_state(self, model_sharded_state_dict, is_loading=False, metadata=None):
        opt, out = self.opt, {}
        self.requests = []
        for index, (param, sharded, start) in enumerate(_shard_params(opt, model_sharded_state_dict)):
            rid, tensors, views, bufs = _replica_id(opt, sharded), _state_tensors(opt, param), {}, {}
            for key, tensor in tensors.items():
                flat = tensor.detach().reshape(-1)
                flat = torch.empty_like(flat, dtype=torch.float32) if is_loading else flat.float()
                bufs[key] = flat  # megatron's format holds float32 whatever the state's dtype
                views[key] = _boxes(sharded, f"{STATE_PREFIX}.{key}.{sharded.key}", flat, start, rid)
            out[index] = views
            self.requests.append((param, bufs, {k: [b.data for b in v] for k, v in views.items()}))
        return out

    @torch.no_grad()
    def load_param_state(self, loaded: dict) -> None:
        opt = self.opt
        precision_aware = getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
        if len(loaded) != len(self.requests):
            raise ValueError(f"optimizer checkpoint: {len(loaded)} parameters loaded, {len(self.requests)} asked for")
        for index, (param, bufs, views) in enumerate(self.requests):
            for key, parts in views.items():
                for view, got in zip(parts, loaded[index][key]):
                    if got.data_ptr() != view.data_ptr():  # loaded into a new tensor, not in place
                        view.copy_(got.reshape(view.shape))
            tensors = dict(bufs)
            if not precision_aware:  # megatron copies every state key of the destination: keep its 0-dim ones
                tensors = {**{k: v for k, v in opt._get_main_param_and_optimizer_states(param).items()
                              if isinstance(v, torch.Tensor) and v.dim() == 0}, **tensors}
            opt._set_main_param_and_optimizer_states(param, tensors)
        self.requests = []


def distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]


@contextlib.contextmanager
def per_shard(optimizer):
    """While active, ``optimizer.sharded_state_dict(metadata=fully_reshardable)`` and ``load_state_dict`` of the
    result write and read each DP rank's own shard (module docstring); other optimizers are untouched."""
    patched = []
    try:
        for opt in distributed_optimizers(optimizer):
            handler = _PerShard(opt)
            opt.sharded_param_state_fully_reshardable = handler.sharded_param_state
            opt.load_parameter_state_from_fully_reshardable = handler.load_param_state
            patched.append(opt)
        yield
    finally:
        for opt in patched:
            del opt.sharded_param_state_fully_reshardable
            del opt.load_parameter_state_from_fully_reshardable
