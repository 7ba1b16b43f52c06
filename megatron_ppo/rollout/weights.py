"""The actor's weights for a rollout engine that holds its own copy (vLLM): HF names, gathered over TP, written by
pipeline stage into a versioned directory the engine loads, so a stale engine is an error, not an off-policy run.

Names and layouts come from the converter's one mapping (convert/mapping.py: ``conversion_pieces`` / ``to_hf``): the
fused QKV is split per query group, SwiGLU's fc1 into gate and up, the vocabulary padding rows dropped. Tied
embeddings export ``model.embed_tokens.weight`` only (as the HF checkpoint holds them) and the manifest says
``tie_word_embeddings``: the engine must re-tie its lm_head.

Every TP rank of a stage sends its shards to the stage's first TP rank (a gather, not an all-gather: only that rank
writes or shares); only the first TP and DP rank of each pipeline stage writes, so nothing is gathered over PP and
each stage's bytes go to disk once. weight_buckets.py hands the same tensors over in memory, a bucket at a time.
On CPU the directory lives on /dev/shm where it exists (docs/rollout.md).
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


def _gather_tp(param: torch.Tensor) -> torch.Tensor | None:
    """The full (TP=1) tensor of a parameter from its TP shards, by megatron's partition attributes, on the TP
    group's first rank only (it alone writes or shares): ``None`` on the others, which send their shard."""
    from megatron.core import parallel_state

    t = param.detach()
    world = parallel_state.get_tensor_model_parallel_world_size()
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return t if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    group = parallel_state.get_tensor_model_parallel_group()
    first = dist.get_global_rank(group, 0)
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        dist.gather(t.contiguous(), None, dst=first, group=group)
        return None
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.gather(t.contiguous(), parts, dst=first, group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = [torch.chunk(p, stride, dim=dim) for p in parts]  # SwiGLU fc1: each shard is [gate_r; up_r]
    return torch.cat([chunks[r][s] for s in range(stride) for r in range(world)], dim=dim)


def stage_hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's parameters under HF names (full TP=1 tensors, the model's dtype), in parameter order,
    on the stage's first TP rank; the other TP ranks only send their shards and yield nothing. A collective over
    the stage's TP group: every TP rank must iterate it to the end."""
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
        full = _gather_tp(param)
        if full is not None:
            tensors, _ = M.to_hf(m, full, arch)
            yield from tensors.items()


def write_weights(model, directory: str, version: int, bucket_bytes: int = 512 << 20,
                  per_replica: bool = False) -> list[str]:
    """Write this stage's HF weights into ``directory`` as safetensors buckets of at most ``bucket_bytes`` (a
    tensor larger than that gets a bucket of its own), named by stage; returns the files this rank wrote (none on
    a rank other than the stage's first TP rank of the first DP replica, or of every replica with
    ``per_replica``: each replica's engine reads its own directory, on its own node). The stage's files of other
    versions are removed first, so a directory never holds two versions' weights. Call on every rank of the
    actor; then ``finish_sync`` on one rank (per replica)."""
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    stage = parallel_state.get_pipeline_model_parallel_rank()
    writer = parallel_state.get_tensor_model_parallel_rank() == 0 and (
        per_replica or parallel_state.get_data_parallel_rank() == 0)
    os.makedirs(directory, exist_ok=True)
    if writer:  # older versions of this stage first: an engine that loaded them no longer reads them
        remove_stage_files(directory, stage, keep=version)
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


def remove_stage_files(directory: str, stage: int, keep: int | None = None) -> None:
    """Remove pipeline stage ``stage``'s weight files of every version but ``keep`` from ``directory``."""
    mine = re.compile(rf"^v(\d+)-stage{stage:03d}-\d+\.safetensors(\.tmp)?$")
    for name in os.listdir(directory):
        m = mine.match(name)
        if m and int(m.group(1)) != keep:
            os.remove(os.path.join(directory, name))


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
    tmp = os.path.join(directory, f"{MANIFEST}.{os.getpid()}.tmp")  # several engine owners may write it
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
