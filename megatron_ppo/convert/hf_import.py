"""Start a role from an HF Llama/Qwen2 checkpoint: convert once (cached, verified by the converter's ledger), then
load the Megatron dist checkpoint into the freshly built model.

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
    """Where converted HF checkpoints are cached: <trainer.default_local_dir>/hf_import."""
    return str(Path(cfg.trainer.expand(cfg.trainer.default_local_dir)) / "hf_import")


def convert_for_roles(cfg, roles) -> dict[str, Path]:
    """Convert every role's HF model.path once, in the driver, before any rank starts: a rank is a process of a
    multi-rank torch.distributed world (the converter needs a world of one), and the TP/PP/DP ranks of a role would
    otherwise race to write the same cache entry."""
    out = {}
    for role in roles:
        path = cfg.model_for(role).path
        if path is not None:
            out[role] = converted_checkpoint(path, hf_import_cache(cfg))
    return out


def converted_checkpoint(hf_dir: str, cache_root: str) -> Path:
    """The Megatron dist checkpoint of ``hf_dir`` under ``cache_root``, converting on a cache miss.

    The cache key is the HF directory's path plus the names, sizes and mtimes of its files, so replacing weights
    in place converts again."""
    from megatron_ppo.convert.pipeline import hf_to_mcore

    src = Path(hf_dir).resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"model.path: {hf_dir} is not a directory")
    stamp = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(src.iterdir()) if p.is_file())
    key = hashlib.sha256(f"{src}|{stamp}".encode()).hexdigest()[:16]
    out = Path(cache_root) / f"{src.name}-{key}"
    if not out.is_dir():  # the converter writes atomically: a directory there is a complete conversion
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"model.path={hf_dir}: no converted checkpoint in {cache_root}; the driver converts "
                               "HF models before the ranks start (convert.hf_import.convert_for_roles)")
        out.parent.mkdir(parents=True, exist_ok=True)
        hf_to_mcore(str(src), str(out), tp=1, pp=1, quiet=True)
        log.info("converted %s -> %s", src, out)
    return out


def load_hf_weights(model, role: str, hf_dir: str, cache_root: str) -> None:
    """Load HF weights into a built GPTModel stage of ``role`` (an LM role: all; a value role from a causal LM: the
    backbone; from a reward model: all, its score head becoming the value head)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megatron_ppo.convert.mapping import arch_from_hf_config, has_score_head
    from megatron_ppo.convert.pipeline import check_mcore_version
    from megatron_ppo import roles

    spec = roles.spec(role)
    score = has_score_head(arch_from_hf_config(hf_dir))
    if spec.value_model and not spec.trainable and not score:  # a frozen value model scores with its head as is
        raise ValueError(f"{spec.model_key}.path={hf_dir} is a causal LM, not a reward model: its score "
                         "head would be random. Give an HF *ForSequenceClassification checkpoint with num_labels=1")
    if not spec.value_model and score:
        raise ValueError(f"{spec.model_key}.path={hf_dir} is a reward model "
                         "(*ForSequenceClassification): it has no LM head to generate or score tokens with")
    ckpt = converted_checkpoint(hf_dir, cache_root)
    check_mcore_version(str(ckpt))  # a cache converted by a newer megatron-core: refused naming both (issue 23)
    sharded = model.sharded_state_dict()
    head = [k for k in sharded if k.startswith("output_layer.")] if spec.value_model and not score else []
    for key in head:
        del sharded[key]
    state = dist_checkpointing.load(sharded, str(ckpt), strict=StrictHandling.ASSUME_OK_UNEXPECTED if head
                                    else StrictHandling.RAISE_ALL)
    result = model.load_state_dict(state, strict=not head)
    if head:
        missing = [k for k in result.missing_keys if not k.startswith("output_layer.")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"{role} from {hf_dir}: missing {missing}, unexpected {result.unexpected_keys}")
        log.info("%s from %s: backbone loaded; value head %s keeps its initialisation", role, hf_dir, head)
