"""The Megatron side of conversion: a dist_checkpointing (torch_dist) checkpoint written and read piece by piece.

Why pieces: ``dist_checkpointing.save`` of a whole model's sharded state dict needs every tensor in memory at once
(one global save plan over all ShardedTensors). megatron-core 0.16.1 has no incremental save, so the writer calls
``dist_checkpointing.save`` once per piece (embedding, each layer, final norm + output layer) into a scratch
directory, moves the piece's ``.distcp`` file(s) into the checkpoint under a unique name, and merges the piece's
DCP ``Metadata`` (chunk lists of the same key across layers, storage locations) into one ``.metadata``. That is
the same metadata surgery megatron's own ``TorchDistLoadShardedStrategy.remove_sharded_tensors`` performs. The
result is an ordinary checkpoint: ``dist_checkpointing.load(model.sharded_state_dict(), dir)`` reads it at any
TP/PP, with the usual access-integrity validation.

Layer tensors are handed to megatron with an explicit leading layer axis of length 1 (global shape
[num_layers, ...], offset layer) rather than ``prepend_axis_num=1``: both describe the same DCP chunks, but
megatron's prepend-axis path builds a torch ShardedTensor that must see the whole layer grid in one save.

Reading (``DistCheckpointReader``) asks ``dist_checkpointing.load`` for one piece at a time the same way. The
DCP ``.metadata`` file is a pickle (torch's format): only read checkpoints you (or your trainer) wrote.

megatron-core 0.19+ keeps dist_checkpointing's common state in the shards (a ``common_state`` object that every
piece writes) rather than in ``common.pt``: the first piece's is kept, the others are dropped from the merged
metadata, and the reader does not list it among the checkpoint's objects (compat/mcore.py has the difference).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ppo.compat import mcore as mcore_compat
from megatron_ppo.convert.mapping import EXTRA_STATE_KEYS, ConversionError, tp_chunks

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def single_process_group():
    """torch.distributed as a world of one (gloo, in-memory store) for dist_checkpointing; reuses an existing one."""
    from megatron_ppo.parallel.platform import enable_cpu_platform

    enable_cpu_platform()  # megatron's writer calls torch.cuda.synchronize(); a no-op shim on CPU-only torch
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConversionError("conversion runs in one process; torch.distributed is initialised with "
                                  f"world size {dist.get_world_size()} (run it outside the training job)")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_strategy():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # One writer thread: one .distcp file per piece and one forked writer process at a time.
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def sharded_objects(key_prefix: str, layer: int, num_layers: int) -> dict:
    """The weightless ``_extra_state`` ShardedObjects a trainer saves for one layer (one per EXTRA_STATE_KEYS)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {}
    for key in EXTRA_STATE_KEYS:
        obj = ShardedObject(key_prefix + key, None, (num_layers,), (layer,), replica_id=0)
        out[obj.unique_key] = obj
    return out


def sharded_tensors(m, tensor: torch.Tensor, num_layers: int, key_prefix: str) -> dict:
    """The ShardedTensors a TP-sharded trainer would save for this tensor: one per TP shard (tp_parts chunks)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    key = key_prefix + m.mcore_key
    layer_offsets = () if m.layer is None else ((0, m.layer, num_layers),)
    shift = 0 if m.layer is None else 1
    chunks = [tensor] if m.tp_axis is None else tp_chunks(tensor, m.tp_axis, m.tp_parts)
    out = {}
    for r, chunk in enumerate(chunks):
        data = chunk if m.layer is None else chunk.unsqueeze(0)
        tp_offsets = () if m.tp_axis is None else ((m.tp_axis + shift, r, m.tp_parts),)
        out[f"{key}@{m.layer}#{r}"] = ShardedTensor.from_rank_offsets(key, data, *layer_offsets, *tp_offsets,
                                                                      replica_id=0)
    return out


class DistCheckpointWriter:
    """Builds one torch_dist checkpoint in ``out_dir`` from successive ``save_piece`` calls, then ``finish``."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.metadata = None
        self.piece_names: set[str] = set()

    def save_piece(self, name: str, sharded_state_dict: dict) -> None:
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint import FileSystemReader

        if name in self.piece_names:
            raise ConversionError(f"dist checkpoint writer: piece {name!r} saved twice")
        self.piece_names.add(name)
        scratch = os.path.join(self.out_dir, f".piece-{name}")
        os.makedirs(scratch)
        # The pieces are partial by design: each covers a few layers of the stacked tensors. Coverage of the whole
        # checkpoint is checked on the merged metadata (verify_coverage), not per piece.
        dist_checkpointing.save(sharded_state_dict, scratch, sharded_strategy=save_strategy(),
                                validate_access_integrity=False)
        md = FileSystemReader(scratch).read_metadata()
        for fname in os.listdir(scratch):
            if fname.endswith(".distcp"):
                os.rename(os.path.join(scratch, fname), os.path.join(self.out_dir, f"{name}{fname}"))
        for info in md.storage_data.values():
            info.relative_path = f"{name}{info.relative_path}"
        if self.metadata is None:
            for fname in (*mcore_compat.common_state_files(), "metadata.json"):
                os.rename(os.path.join(scratch, fname), os.path.join(self.out_dir, fname))
            self.metadata = md
        else:
            self._merge(md)
        shutil.rmtree(scratch)

    def _merge(self, md) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        merged = self.metadata.state_dict_metadata
        for key, meta in md.state_dict_metadata.items():
            if mcore_compat.is_common_state_key(key):  # 0.19+: every piece writes it; the first piece's is kept
                continue
            if key not in merged:
                merged[key] = meta
                continue
            have = merged[key]
            if not (isinstance(have, TensorStorageMetadata) and isinstance(meta, TensorStorageMetadata)):
                raise ConversionError(f"dist checkpoint writer: object {key!r} written by two pieces")
            if have.size != meta.size or have.properties.dtype != meta.properties.dtype:
                raise ConversionError(f"dist checkpoint writer: {key!r} is {tuple(meta.size)} {meta.properties.dtype}"
                                      f" in one piece, {tuple(have.size)} {have.properties.dtype} in another")
            have.chunks.extend(meta.chunks)
        for idx, info in md.storage_data.items():
            if mcore_compat.is_common_state_key(idx.fqn):
                continue
            if idx in self.metadata.storage_data:
                raise ConversionError(f"dist checkpoint writer: chunk {idx.fqn} at {tuple(idx.offset or ())} "
                                      "written twice")
            self.metadata.storage_data[idx] = info
        if md.planner_data:
            self.metadata.planner_data = {**(self.metadata.planner_data or {}), **md.planner_data}

    def finish(self) -> None:
        if self.metadata is None:
            raise ConversionError("dist checkpoint writer: nothing was saved")
        # Cached per-rank save plans describe one piece only; drop them (megatron then re-plans on the next save).
        if hasattr(self.metadata, "all_local_plans"):
            self.metadata.all_local_plans = None
        path = os.path.join(self.out_dir, ".metadata")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(self.metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(path + ".tmp", path)


@dataclass(frozen=True)
class StoredTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class DistCheckpointReader:
    """What a torch_dist checkpoint holds (from its metadata) and piecewise reads of it."""

    def __init__(self, ckpt_dir: str):
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        if not os.path.isdir(ckpt_dir):
            raise ConversionError(f"--mcore {ckpt_dir}: not a directory")
        if not dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir):
            raise ConversionError(f"--mcore {ckpt_dir}: not a Megatron dist_checkpointing checkpoint "
                                  "(no metadata.json)")
        if not os.path.isfile(os.path.join(ckpt_dir, ".metadata")):
            raise ConversionError(f"--mcore {ckpt_dir}: no .metadata (only the torch_dist backend is supported)")
        self.dir = ckpt_dir
        try:
            md = FileSystemReader(ckpt_dir).read_metadata()
        except Exception as e:
            raise ConversionError(f"--mcore {ckpt_dir}: cannot read .metadata ({e})") from e
        self.tensors: dict[str, StoredTensor] = {}
        self.objects: list[str] = []
        self.chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        for key, meta in md.state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                self.tensors[key] = StoredTensor(key, tuple(meta.size), meta.properties.dtype)
                self.chunks[key] = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
            elif isinstance(meta, BytesStorageMetadata) and not mcore_compat.is_common_state_key(key):
                self.objects.append(key)  # 0.19+'s common_state object is dist_checkpointing's own, not ours

    def read(self, requests: list[tuple[str, int | None]]) -> dict[tuple[str, int | None], torch.Tensor]:
        """Full (TP-gathered) tensors for (key, layer) pairs; layer None for unstacked tensors."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sharded = {}
        for key, layer in requests:
            st = self.tensors[key]
            if layer is None:
                sharded[(key, None)] = ShardedTensor.from_rank_offsets(
                    key, torch.empty(st.shape, dtype=st.dtype), replica_id=0)
            else:
                sharded[(key, layer)] = ShardedTensor.from_rank_offsets(
                    key, torch.empty((1,) + st.shape[1:], dtype=st.dtype), (0, layer, st.shape[0]), replica_id=0)
        # dist_checkpointing wants string keys in the state dict container.
        names = {f"{key}@{layer}": (key, layer) for key, layer in sharded}
        state = {name: sharded[kl] for name, kl in names.items()}
        loaded = dist_checkpointing.load(state, self.dir, validate_access_integrity=False)
        out = {}
        for name, kl in names.items():
            t = loaded[name]
            out[kl] = t if kl[1] is None else t[0]
        return out


Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def chunk_coverage_problems(shape: tuple[int, ...], chunks: list[Chunk]) -> str | None:
    """None if the chunks tile the tensor exactly (every element written once), else what is wrong."""
    total = 1
    for s in shape:
        total *= s
    covered = 0
    boxes = []
    for off, size in chunks:
        if len(off) != len(shape) or any(o < 0 or o + z > s for o, z, s in zip(off, size, shape)):
            return f"chunk at {off} of size {size} lies outside {shape}"
        n = 1
        for z in size:
            n *= z
        covered += n
        boxes.append((off, size))
    boxes.sort()
    # Sorted by offset: only boxes starting inside oa's first-axis span can overlap it.
    for i, (oa, za) in enumerate(boxes):
        for ob, zb in boxes[i + 1:]:
            if shape and ob[0] >= oa[0] + za[0]:
                break
            if all(a < b + y and b < a + x for a, x, b, y in zip(oa, za, ob, zb)):
                return f"chunks at {oa} and {ob} overlap"
    if covered != total:
        return f"chunks cover {covered} of {total} elements"
    return None
