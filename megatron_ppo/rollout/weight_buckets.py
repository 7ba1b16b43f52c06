"""The actor's weights handed to an engine one bucket at a time (rollout.vllm.weight_transport=ipc): verl's and
NeMo-RL's bucketed refit, so a sync holds one bucket of extra memory, not a copy of the stage.

A bucket is one flat byte buffer holding whole HF tensors at aligned offsets, plus their names, shapes and dtypes.
Each pipeline stage's first TP rank fills buckets from ``weights.stage_hf_weights`` (every parameter gathered to that
rank only), and the stages go in order: a stage's buckets are handed to the engine by an owner on that stage, and
sent over point-to-point to the replica's engine owners on other stages (the pipeline relay: an engine sees every
layer, whichever stage holds it, and every handle it opens points at memory on its owner's node). The owner shares a
bucket with its engine (CUDA IPC on a GPU, shared memory on the CPU) and waits for the engine to finish with it
before the next is filled; a fresh buffer per bucket, so a tensor the engine still refers to is never overwritten.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ppo.rollout.weights import stage_hf_weights

ALIGN = 256  # bytes: every tensor starts at an offset its dtype (and any vectorised copy) can view


@dataclass
class Bucket:
    """HF tensors packed into ``flat`` (uint8): tensor i is ``flat[offsets[i]:][:nbytes[i]]`` viewed as
    ``dtypes[i]`` and ``shapes[i]``."""
    flat: torch.Tensor
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    used: int = 0

    def meta(self) -> dict:
        return {"names": self.names, "shapes": self.shapes, "dtypes": self.dtypes, "offsets": self.offsets,
                "nbytes": self.nbytes, "used": self.used}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        offset = -(-self.used // ALIGN) * ALIGN
        self.flat[offset:offset + n].view(tensor.dtype).copy_(tensor.reshape(-1))
        self.names.append(name)
        self.shapes.append(tuple(tensor.shape))
        self.dtypes.append(str(tensor.dtype).replace("torch.", ""))
        self.offsets.append(offset)
        self.nbytes.append(n)
        self.used = offset + n

    def fits(self, tensor: torch.Tensor) -> bool:
        return -(-self.used // ALIGN) * ALIGN + tensor.numel() * tensor.element_size() <= self.flat.numel()


def tensors_of(flat: torch.Tensor, meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of a bucket (views of ``flat``; the engine process has its own copy of this loop)."""
    for name, shape, dtype, offset, n in zip(meta["names"], meta["shapes"], meta["dtypes"], meta["offsets"],
                                             meta["nbytes"]):
        yield name, flat[offset:offset + n].view(getattr(torch, dtype)).view(shape)


def new_buffer(nbytes: int, device: torch.device, shared: bool) -> torch.Tensor:
    """A fresh bucket buffer; on the CPU in shared memory when another process opens it (torch's ``file_system``
    strategy: a process that is not our child can open it by name)."""
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if shared and device.type == "cpu":
        import torch.multiprocessing as mp

        mp.set_sharing_strategy("file_system")
        flat.share_memory_()
    return flat


def stage_bytes(model) -> int:
    """This stage's parameters at TP=1 (what the first TP rank gathers), in bytes: at least its HF tensors' bytes
    (the HF export drops the vocabulary padding)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    return sum(p.numel() * p.element_size() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
               for p in model.parameters())


def stage_buckets(model, bucket_bytes: int, shared: bool) -> Iterator[Bucket]:
    """This stage's HF weights in buckets of ``bucket_bytes`` (a larger tensor: a bucket of its own), filled as the
    tensors are gathered, on the stage's first TP rank; the other TP ranks send their shards and get nothing. A
    collective over the stage's TP group: every TP rank iterates it to the end."""
    device = next(model.parameters()).device
    left = stage_bytes(model)  # an upper bound on what is still to come: a small stage gets a small buffer
    bucket = None
    for name, tensor in stage_hf_weights(model):
        if bucket is not None and not bucket.fits(tensor):
            yield bucket
            bucket = None
        n = tensor.numel() * tensor.element_size()
        if bucket is None:
            size = max(min(bucket_bytes, left + ALIGN * 64), n)  # alignment padding of up to 64 tensors
            bucket = Bucket(new_buffer(size, device, shared))
        bucket.add(name, tensor)
        left -= n
        del tensor
    if bucket is not None:
        yield bucket


def relay_buckets(model, bucket_bytes: int, owners: Sequence[int],
                  hand: Callable[[torch.Tensor, dict], None] | None) -> dict:
    """Every rank of the actor: the replica's weights, stage by stage, bucket by bucket, to ``hand(flat, meta)`` on
    each engine owner of this replica (``owners``: their global ranks, all first TP ranks of their stage); a
    stage's buckets travel from its first TP rank to the owners on other stages by point-to-point send / recv.
    Returns (on an owner) {"names": every tensor handed, "peak_bucket_bytes": the largest bucket held}."""
    from megatron.core import parallel_state

    me = dist.get_rank()
    tp0 = parallel_state.get_tensor_model_parallel_rank() == 0
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    owner = me in owners
    if owner and hand is None:
        raise ValueError("relay_buckets: an owner needs a hand-over function")
    device = next(model.parameters()).device
    names, peak = [], 0
    for stage in range(stages):
        if stage == my_stage:
            others = [o for o in owners if o != me] if tp0 else []
            for bucket in stage_buckets(model, bucket_bytes, shared=owner):
                flat = bucket.flat[:bucket.used]
                meta = bucket.meta()
                peak = max(peak, bucket.flat.numel())
                if owner:
                    hand(flat, meta)
                    names += meta["names"]
                for dst in others:
                    dist.send_object_list([meta], dst=dst)
                    dist.send(flat, dst=dst)
                del bucket, flat
            for dst in others:
                dist.send_object_list([None], dst=dst)
        elif owner:
            src = dist.get_global_rank(parallel_state.get_pipeline_model_parallel_group(), stage)
            while True:
                box = [None]
                dist.recv_object_list(box, src=src)
                meta = box[0]
                if meta is None:
                    break
                flat = new_buffer(meta["used"], device, shared=True)
                dist.recv(flat, src=src)
                peak = max(peak, flat.numel())
                hand(flat, meta)
                names += meta["names"]
                del flat
    return {"names": names, "peak_bucket_bytes": peak}
