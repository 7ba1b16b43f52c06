"""The actor's weights for a rollout engine that holds its own copy (vLLM): HF names, gathered over TP, written by
pipeline stage into a versioned directory the engine loads, so a stale engine is an error, not an off-policy run.

Names and layouts come from the converter's one mapping (convert/mapping.py: ``conversion_pieces`` / ``to_hf``): the
fused QKV is split per query group, SwiGLU's fc1 into gate and up, the vocabulary padding rows dropped. Tied
embeddings export ``model.embed_tokens.weight`` only (as the HF checkpoint holds them) and the manifest says
``tie_word_embeddings``: the engine must re-tie its lm_head.

Every TP rank of a stage takes part in the gathers (collectives); only the first TP and DP rank of each pipeline
stage writes, so nothing is gathered over PP and each stage's bytes go to disk once. On CPU the directory lives on
/dev/shm where it exists (docs/rollout.md).
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_ppo import roles
from megatron_ppo.convert import mapping as M
from megatron_ppo.models.unwrap import unwrap_model

MANIFEST = "sync.json"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# this model's parameter (local or TE spec) -> the converter's Megatron key
_LAYER_KEYS = {
    "input_layernorm.weight": M.QKV_NORM,
    "self_attention.linear_qkv.layer_norm_weight": M.QKV_NORM,
    "self_attention.linear_qkv.weight": M.QKV_WEIGHT,
    "self_attention.linear_qkv.bias": M.QKV_BIAS,
    "self_attention.linear_proj.weight": M.PROJ_WEIGHT,
    "pre_mlp_layernorm.weight": M.FC1_NORM,
    "mlp.linear_fc1.layer_norm_weight": M.FC1_NORM,
    "mlp.linear_fc1.weight": M.FC1_WEIGHT,
    "mlp.linear_fc2.weight": M.FC2_WEIGHT,
}


class StaleWeightsError(RuntimeError):
    """The engine was about to generate with weights of another version than the actor's."""


def _tensor_maps(arch) -> dict[tuple[str, int | None], M.TensorMap]:
    return {(m.mcore_key, m.layer): m for piece in M.conversion_pieces(arch, tp=1) for m in piece.maps}


def _gather_tp(param: torch.Tensor) -> torch.Tensor:
    """The full (TP=1) tensor of a parameter from its TP shards, by megatron's partition attributes."""
    from megatron.core import parallel_state

    t = param.detach()
    world = parallel_state.get_tensor_model_parallel_world_size()
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = [torch.chunk(p, stride, dim=dim) for p in parts]  # SwiGLU fc1: each shard is [gate_r; up_r]
    return torch.cat([chunks[r][s] for s in range(stride) for r in range(world)], dim=dim)


def stage_hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's parameters under HF names (full TP=1 tensors, the model's dtype), in parameter order.
    A collective over the stage's TP group: every TP rank must iterate it to the end."""
    core = unwrap_model(model)
    arch = core.arch
    if M.has_score_head(arch) or roles.spec(getattr(core, "role", "actor")).value_model:
        raise ValueError("stage_hf_weights: a value model has no LM weights for a rollout engine")
    maps = _tensor_maps(arch)
    layers = core.decoder.layers
    offset = layers[0].layer_number - 1 if len(layers) else 0
    for name, param in core.named_parameters():
        if name == "output_layer.weight" and core.share_embeddings_and_output_weights:
            continue  # tied: HF holds the embedding only
        match = _LAYER.match(name)
        if match:
            local = match.group(2)
            if local not in _LAYER_KEYS:
                raise KeyError(f"stage_hf_weights: no HF mapping for parameter {name!r}")
            key, layer = _LAYER_KEYS[local], int(match.group(1)) + offset
        else:
            key, layer = name, None
        m = maps.get((key, layer))
        if m is None:
            raise KeyError(f"stage_hf_weights: parameter {name!r} (Megatron key {key}, layer {layer}) is not in the "
                           "converter's mapping for this architecture")
        tensors, _ = M.to_hf(m, _gather_tp(param), arch)
        yield from tensors.items()


def write_weights(model, directory: str, version: int, bucket_bytes: int = 512 << 20,
                  per_replica: bool = False) -> list[str]:
    """Write this stage's HF weights into ``directory`` as safetensors buckets of at most ``bucket_bytes`` (a
    tensor larger than that gets a bucket of its own), named by stage; returns the files this rank wrote (none on
    a rank other than the stage's first TP rank of the first DP replica, or of every replica with
    ``per_replica``: each replica's engine reads its own directory, on its own node). Call on every rank of the
    actor; then ``finish_sync`` on one rank (per replica)."""
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    stage = parallel_state.get_pipeline_model_parallel_rank()
    writer = parallel_state.get_tensor_model_parallel_rank() == 0 and (
        per_replica or parallel_state.get_data_parallel_rank() == 0)
    os.makedirs(directory, exist_ok=True)
    files, bucket, size = [], {}, 0

    def flush():
        nonlocal bucket, size
        if bucket and writer:
            path = os.path.join(directory, f"v{version}-stage{stage:03d}-{len(files):04d}.safetensors")
            save_file({k: v.contiguous() for k, v in bucket.items()}, path + ".tmp", metadata={"version": str(version)})
            os.replace(path + ".tmp", path)
            files.append(path)
        bucket, size = {}, 0

    for name, tensor in stage_hf_weights(model):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
        bucket[name] = tensor
        size += nbytes
    flush()
    return files


def share_weights(model) -> tuple[list[tuple[str, tuple]], list[torch.Tensor]]:
    """This stage's HF weights as handles another process on this node rebuilds without a copy through disk:
    CUDA IPC handles on a GPU, shared-memory names on the CPU (torch.multiprocessing's reductions; the
    ``file_system`` strategy, so an unrelated process can open them). Returns (name, (rebuild_fn, args)) pairs
    and the tensors behind them, which must stay alive until the engine has loaded them; both empty on a rank
    other than the stage's first TP rank. A collective over the stage's TP group, like ``stage_hf_weights``."""
    import torch.multiprocessing as mp
    from megatron.core import parallel_state
    from torch.multiprocessing.reductions import reduce_tensor

    writer = parallel_state.get_tensor_model_parallel_rank() == 0
    handles, keep = [], []
    for name, tensor in stage_hf_weights(model):
        if not writer:
            continue
        if tensor.device.type == "cpu":  # one copy, straight into shared memory
            mp.set_sharing_strategy("file_system")
            t = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
            t.copy_(tensor)
        else:
            t = tensor.detach().clone()  # never the live parameter: the copy is what the engine reads
        handles.append((name, reduce_tensor(t)))
        keep.append(t)
    return handles, keep


def check_complete(names: list[str], arch, version: int, where: str) -> None:
    """The HF tensors handed to an engine for sync ``version`` are the architecture's, each exactly once."""
    seen, twice = set(), []
    for name in names:
        (twice.append(name) if name in seen else seen.add(name))
    expected = set(M.hf_tensor_shapes(arch))
    if twice or seen != expected:
        raise ValueError(f"weight sync v{version} ({where}): missing {sorted(expected - seen)[:5]}, unexpected "
                         f"{sorted(seen - expected)[:5]}, repeated {sorted(twice)[:5]}")


def finish_sync(directory: str, version: int, files: list[str], arch) -> dict:
    """Write the manifest naming ``version``, its files and every HF tensor they hold, after every stage wrote;
    refuses a set of files that misses or repeats an HF tensor of the architecture."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    for path in sorted(files):
        with safe_open(path, "pt") as f:
            if f.metadata().get("version") != str(version):
                raise StaleWeightsError(f"{path}: version {f.metadata().get('version')}, expected {version}")
            for name in f.keys():
                if name in names:
                    raise ValueError(f"{name} written twice ({names[name]}, {path})")
                names[name] = os.path.basename(path)
    expected = set(M.hf_tensor_shapes(arch))
    if set(names) != expected:
        raise ValueError(f"weight sync v{version}: missing {sorted(expected - set(names))[:5]}, unexpected "
                         f"{sorted(set(names) - expected)[:5]}")
    manifest = {"version": version, "files": sorted(os.path.basename(p) for p in files),
                "tensors": names, "tie_word_embeddings": bool(arch.tie_word_embeddings)}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, os.path.join(directory, MANIFEST))
    return manifest


def write_hf_config(directory: str, arch, dtype: str) -> str:
    """``config.json`` of the HF model these weights are (convert/mapping.hf_config_dict), for an engine that
    loads the directory as an HF model."""
    path = os.path.join(directory, "config.json")
    with open(path + ".tmp", "w") as f:
        json.dump(M.hf_config_dict(arch, dtype), f, indent=1)
    os.replace(path + ".tmp", path)
    return path


def read_weights(directory: str, version: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The HF tensors of sync ``version`` and the manifest; StaleWeightsError if the directory holds another."""
    from safetensors.torch import load_file

    with open(os.path.join(directory, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest["version"] != version:
        raise StaleWeightsError(f"{directory}: holds weights of sync version {manifest['version']}, the actor is at "
                                f"{version}: the engine would generate with an old policy")
    out = {}
    for name in manifest["files"]:
        out.update(load_file(os.path.join(directory, name)))
    return out, manifest
