"""A rank of a role starts from an HF checkpoint by reading only its own slices of it.

megatron's ``sharded_state_dict()`` says what each local tensor of a rank is: a box (a layer; TP rows or columns)
of a global Megatron tensor. ``mapping.row_segments`` says which rows of which HF tensors make that box. The rank
copies exactly those rows and columns (safetensors ``get_slice(name)[rows, cols]``, or a slice of a memory-mapped
``pytorch_model*.bin`` tensor) into its parameters, in place: no converted checkpoint, no full tensor on any rank
(a TP=1 conversion loaded with dist_checkpointing made every TP rank read its stage's whole tensors), and nothing
converted in the driver.

What the converter's ledger proved still holds, for the role as a whole, from the box metadata
dist_checkpointing.load exchanges too (one all_gather_object): before anything is read, every expected HF tensor
is present with its shape and a float dtype and nothing is unknown (hf_io.check_hf_inventory); the main replicas'
boxes tile every global Megatron tensor exactly once (megatron's validate_sharding_integrity); their reads tile
every HF tensor exactly once (check_role_reads: nothing dropped, nothing read twice); a model tensor no HF tensor maps to, or of another shape than the config's, is an error naming it; a
stored tied ``lm_head`` equals the embedding on every row a rank reads.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ppo.convert.hf_io import HFCheckpoint, check_hf_inventory
from megatron_ppo.convert.mapping import (
    HF_EMBED,
    HF_LM_HEAD,
    ConversionError,
    TensorMap,
    conversion_pieces,
    hf_tensor_shapes,
    row_segments,
)
from megatron_ppo.convert.mcore_io import chunk_coverage_problems
from megatron_ppo.models.vocab_rows import vocab_rows_problem

# Rows are copied in blocks of about this many bytes of the HF file: what a rank maps (safetensors 0.8's slices are
# views of the memory-mapped file) or allocates (a version that copies) at once, whatever the tensor's size.
READ_BLOCK_BYTES = 32 << 20


@dataclass(frozen=True)
class Box:
    """The part of one layer's global Megatron tensor a local tensor holds: rows [r0, r1) and ``cols`` (None: all)."""

    m: TensorMap
    r0: int
    r1: int
    cols: slice | None


@dataclass
class SliceImport:
    """What one rank's import did: its local tensors filled and the HF bytes it read, against the checkpoint's."""

    tensors: int
    bytes_read: int
    hf_bytes: int
    params_in: int  # role-wide: HF parameters read by the main replicas (each exactly once)
    padding: int  # role-wide: zero vocab-padding parameters written


def tensor_maps(arch) -> dict[tuple[str, int | None], TensorMap]:
    """(Megatron key, layer) -> its TensorMap (vocab rows are taken from the model: any layout's padding)."""
    return {(m.mcore_key, m.layer): m for piece in conversion_pieces(arch, 1) for m in piece.maps}


def plan_box(sh, maps: dict, arch) -> Box:
    """The box a ShardedTensor (with or without data) covers; an error naming the key when the model's tensor is
    not the HF config's."""
    n = sh.prepend_axis_num
    if n > 1 or sh.flattened_range is not None:
        raise ConversionError(f"model tensor {sh.key!r}: a flattened or multi-axis-prepended shard is not supported")
    layer = sh.global_offset[0] if n else None
    where = f"model tensor {sh.key!r}" + (f" (layer {layer})" if n else "")
    m = maps.get((sh.key, layer))
    if m is None:
        raise ConversionError(f"{where}: no HF tensor maps to it")
    if n and sh.global_shape[0] != arch.num_layers:
        raise ConversionError(f"{where}: stacks {sh.global_shape[0]} layers, the HF config has {arch.num_layers}")
    shape, off, size = tuple(sh.global_shape[n:]), tuple(sh.global_offset[n:]), tuple(sh.local_shape)
    if m.kind == "vocab":
        rows_problem = vocab_rows_problem(shape[0], arch) if shape else "no rows"
        ok = not rows_problem and shape[1:] == m.shape[1:]
    else:
        ok = shape == m.shape
    if not ok or len(size) != len(shape) or len(shape) > 2:
        raise ConversionError(f"{where}: global shape {shape}, local {size}; the HF config's is {m.shape} "
                              "(the model is not built from this HF config)")
    cols = None
    if len(shape) == 2 and size[1] != shape[1]:
        cols = slice(off[1], off[1] + size[1])
    return Box(m, off[0], off[0] + size[0], cols)


def fill(dest: torch.Tensor, box: Box, arch, ck: HFCheckpoint, tied_duplicate: bool) -> None:
    """Copy the box's HF rows into ``dest`` (zeros for vocab padding). tied_duplicate: the checkpoint also stores
    ``lm_head.weight`` of a tied model; it must equal the embedding on the rows read."""
    for seg in row_segments(box.m, arch, box.r0, box.r1):
        if seg.hf_name is None:
            dest[seg.dst: seg.dst + seg.stop - seg.start].zero_()
            continue
        e = ck.entries[seg.hf_name]
        step = max(1, READ_BLOCK_BYTES // max(1, e.numel // max(1, e.shape[0]) * e.dtype.itemsize))
        for a in range(seg.start, seg.stop, step):
            b = min(a + step, seg.stop)
            src = ck.read_slice(seg.hf_name, slice(a, b), box.cols)
            if tied_duplicate and seg.hf_name == HF_EMBED:
                if not torch.equal(ck.read_slice(HF_LM_HEAD, slice(a, b), box.cols), src):
                    raise ConversionError(f"--hf {ck.dir}: tie_word_embeddings is true but {HF_LM_HEAD} differs "
                                          f"from {HF_EMBED} (rows {a}:{b})")
            dest[seg.dst + a - seg.start: seg.dst + b - seg.start].copy_(src)
            del src


def check_role_reads(arch, ck: HFCheckpoint, shardings_by_rank, maps: dict, skipped: set[str]) -> tuple[int, int]:
    """Every HF tensor (but ``skipped``) read exactly once by the role's main replicas: their reads tile it. Pure
    (metadata only; the same on every rank). Returns (HF parameters read, zero padding parameters written)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    boxes: dict[str, list] = defaultdict(list)
    padding = 0
    for shardings in shardings_by_rank:
        for sh in shardings:
            if not isinstance(sh, ShardedTensor) or not is_main_replica(sh.replica_id):
                continue
            box = plan_box(sh, maps, arch)
            ncols = box.m.shape[1] if len(box.m.shape) > 1 else 1
            if box.cols is not None:
                ncols = box.cols.stop - box.cols.start
            for seg in row_segments(box.m, arch, box.r0, box.r1):
                if seg.hf_name is None:
                    padding += (seg.stop - seg.start) * ncols
                    continue
                shape = ck.entries[seg.hf_name].shape
                c0, cn = (box.cols.start, ncols) if box.cols is not None else (0, ncols)
                boxes[seg.hf_name].append(((seg.start,) + ((c0,) if len(shape) > 1 else ()),
                                           (seg.stop - seg.start,) + ((cn,) if len(shape) > 1 else ())))
    problems, params_in = [], 0
    for name, shape in hf_tensor_shapes(arch).items():
        if name in skipped:
            continue
        if name not in boxes:
            problems.append(f"{name!r} is read by no rank")
            continue
        problem = chunk_coverage_problems(shape, boxes[name])
        if problem:
            problems.append(f"{name!r}: {problem}")
        params_in += sum(torch.Size(size).numel() for _, size in boxes[name])
    if problems:
        raise ConversionError(f"--hf {ck.dir}: the role's ranks would not read every HF tensor exactly once: "
                              + "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))
    return params_in, padding


def _expand(sharded: dict) -> list[tuple[str, object, list]]:
    """(state key, the entry, its ShardedTensors/Objects): a factory (SwiGLU's fc1) built into its parts."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    out = []
    for key, v in sharded.items():
        if isinstance(v, ShardedTensorFactory):
            parts = v.build()
            out.append((key, v, list(parts) if isinstance(parts, (list, tuple)) else [parts]))
        elif isinstance(v, ShardedBase):
            out.append((key, v, [v]))
        else:
            raise ConversionError(f"model state {key!r}: {type(v).__name__} is not a sharded tensor or object")
    return out


def _global_shardings(entries) -> list[list]:
    """Every rank's ShardedTensor/Object metadata (dist_checkpointing.load's exchange), after megatron's own
    check that the main replicas tile every global tensor exactly once."""
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    flat = {i: sh for i, sh in enumerate(p for _, _, parts in entries for p in parts)}
    if not dist.is_initialized():
        return [[sh.without_data() for sh in flat.values()]]
    _, global_metadata = determine_global_metadata(flat)
    validate_sharding_integrity(global_metadata)  # raises on rank 0, as in dist_checkpointing.load
    return global_metadata


def load_slices(sharded: dict, ck: HFCheckpoint, arch, skipped: set[str] = frozenset()) -> tuple[dict, SliceImport]:
    """Fill the tensors of ``sharded`` (a model's sharded_state_dict, its parameters in place) from their slices of
    ``ck``; return the state dict for ``load_state_dict`` (the filled parameters themselves) and what was read.
    Collective: every rank of the world calls it (the box metadata is all-gathered). ``skipped``: HF tensors
    deliberately left unread (a critic's LM head)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    classes = check_hf_inventory(arch, ck)
    tied = bool(classes["tied_duplicate"])
    skipped = set(skipped) | ({HF_LM_HEAD} if tied else set())
    for piece in conversion_pieces(arch, 1):  # fused tensors share a dtype (headers only)
        for m in piece.maps:
            dts = {ck.entries[n].dtype for n in m.hf_names}
            if len(dts) > 1:
                raise ConversionError(f"--hf {ck.dir}: {m.hf_names} are fused into {m.mcore_key} but have dtypes "
                                      f"{sorted(map(str, dts))}")
    maps = tensor_maps(arch)
    entries = _expand(sharded)
    params_in, padding = check_role_reads(arch, ck, _global_shardings(entries), maps, skipped)

    state, count = {}, 0
    with torch.no_grad():
        for key, entry, parts in entries:
            if isinstance(entry, ShardedObject):
                state[key] = entry.data  # weightless _extra_state: the module's own
                continue
            for sh in parts:
                if sh.data is None or tuple(sh.data.shape) != tuple(sh.local_shape):
                    raise ConversionError(f"model tensor {key!r}: no local data of shape {sh.local_shape}")
                fill(sh.data, plan_box(sh, maps, arch), arch, ck, tied)
                count += 1
            if isinstance(entry, ShardedTensorFactory):  # the parts may be copies: write the merge through
                entry.data.copy_(entry.merge_fn([sh.data for sh in parts]))
            state[key] = entry.data
    hf_bytes = sum(ck.entries[n].numel * ck.entries[n].dtype.itemsize for n in hf_tensor_shapes(arch))
    return state, SliceImport(count, ck.bytes_read, hf_bytes, params_in, padding)
