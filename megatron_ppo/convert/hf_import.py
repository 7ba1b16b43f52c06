"""Start a role from an HF Llama/Qwen2 checkpoint: every rank reads only its own slices of the HF files
(convert/hf_slices.py) into its freshly built model stage. Nothing is converted or cached; the driver only checks
the checkpoint's headers before any rank starts.

An HF causal LM gives the actor and reference everything; a critic takes its backbone and its value head keeps its
initialisation (the LM head, or the tied embedding, is deliberately left out — logged, not silently). An HF reward
model (*ForSequenceClassification, num_labels=1) gives a reward model or a critic everything, its ``score`` head
becoming the value head. A reward model from a causal LM (random score head) and a policy from a reward model (no LM
head) are refused.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def hf_import_cache(cfg) -> str:
    """Where ``converted_checkpoint`` caches converted HF checkpoints: <trainer.default_local_dir>/hf_import. The
    roles no longer read it (``load_hf_weights`` reads the HF files)."""
    return str(Path(cfg.trainer.expand(cfg.trainer.default_local_dir)) / "hf_import")


def convert_for_roles(cfg, roles) -> dict[str, Path]:
    """Check every role's HF model.path in the driver, before any rank starts: a supported config, every tensor
    present with its shape and a float dtype, nothing unknown (file headers only; nothing is read or converted).
    Returns {role: its HF directory}."""
    from megatron_ppo.convert.hf_io import HFCheckpoint, check_hf_inventory
    from megatron_ppo.convert.mapping import arch_from_hf_config

    out = {}
    for role in roles:
        path = cfg.model_for(role).path
        if path is not None:
            src = _hf_dir(path)
            check_hf_inventory(arch_from_hf_config(str(src)), HFCheckpoint(str(src)))
            out[role] = src
    return out


def _hf_dir(hf_dir: str) -> Path:
    src = Path(hf_dir).resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"model.path: {hf_dir} is not a directory")
    return src


def converted_checkpoint(hf_dir: str, cache_root: str) -> Path:
    """The Megatron dist checkpoint of ``hf_dir`` under ``cache_root``, converting (at TP=1, PP=1) on a cache miss:
    for tools that want a Megatron checkpoint of an HF model; a role starting from HF weights does not need one.

    The cache key is the HF directory's path plus the names, sizes and mtimes of its files, so replacing weights
    in place converts again."""
    from megatron_ppo.convert.pipeline import hf_to_mcore

    src = _hf_dir(hf_dir)
    stamp = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(src.iterdir()) if p.is_file())
    key = hashlib.sha256(f"{src}|{stamp}".encode()).hexdigest()[:16]
    out = Path(cache_root) / f"{src.name}-{key}"
    if not out.is_dir():  # the converter writes atomically: a directory there is a complete conversion
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"model.path={hf_dir}: no converted checkpoint in {cache_root}; the converter runs in "
                               "a world of one (convert it before the ranks start)")
        out.parent.mkdir(parents=True, exist_ok=True)
        hf_to_mcore(str(src), str(out), tp=1, pp=1, quiet=True)
        log.info("converted %s -> %s", src, out)
    return out


def load_hf_weights(model, role: str, hf_dir: str, cache_root: str | None = None):
    """Load HF weights into a built GPTModel stage of ``role`` (an LM role: all; a value role from a causal LM: the
    backbone; from a reward model: all, its score head becoming the value head), each rank reading only its own
    slices of the HF files. Collective over the world (the ranks' shard boxes are exchanged and checked). Returns
    the rank's ``hf_slices.SliceImport``. ``cache_root`` is unused (HF weights are no longer converted first)."""
    from megatron_ppo import roles
    from megatron_ppo.convert.hf_io import HFCheckpoint
    from megatron_ppo.convert.hf_slices import load_slices
    from megatron_ppo.convert.mapping import HF_LM_HEAD, arch_from_hf_config, has_score_head

    spec = roles.spec(role)
    arch = arch_from_hf_config(hf_dir)
    score = has_score_head(arch)
    if spec.value_model and not spec.trainable and not score:  # a frozen value model scores with its head as is
        raise ValueError(f"{spec.model_key}.path={hf_dir} is a causal LM, not a reward model: its score "
                         "head would be random. Give an HF *ForSequenceClassification checkpoint with num_labels=1")
    if not spec.value_model and score:
        raise ValueError(f"{spec.model_key}.path={hf_dir} is a reward model "
                         "(*ForSequenceClassification): it has no LM head to generate or score tokens with")
    ck = HFCheckpoint(str(_hf_dir(hf_dir)))
    sharded = model.sharded_state_dict()
    head = [k for k in sharded if k.startswith("output_layer.")] if spec.value_model and not score else []
    for key in head:
        del sharded[key]
    state, report = load_slices(sharded, ck, arch, skipped={HF_LM_HEAD} if spec.value_model and not score else set())
    result = model.load_state_dict(state, strict=not head)
    if head:
        missing = [k for k in result.missing_keys if not k.startswith("output_layer.")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"{role} from {hf_dir}: missing {missing}, unexpected {result.unexpected_keys}")
        log.info("%s from %s: backbone loaded; value head %s keeps its initialisation", role, hf_dir, head)
    log.info("%s from %s: %d local tensors, read %.1f of the checkpoint's %.1f MiB", role, hf_dir, report.tensors,
             report.bytes_read / 2**20, report.hf_bytes / 2**20)
    return report
