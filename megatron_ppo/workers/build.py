"""What a role's model shard is made of, from the config: architecture, dtype, activation checkpointing.

Pure functions of (config, role): the driver (vocab checks) and every rank (building its shard) agree on them.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ppo.models.arch import ModelArch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_arch(cfg, role: str, vocab_size: int) -> ModelArch:
    """The role's architecture: from its HF config.json (model.path) or inline (model.arch, random init)."""
    model = cfg.model_for(role)
    if model.path is not None:
        from megatron_ppo.convert.mapping import arch_from_hf_config

        arch = arch_from_hf_config(model.path)
        if arch.vocab_size < vocab_size:
            raise ValueError(f"{role}.model.path={model.path}: vocab_size {arch.vocab_size} is smaller than the "
                             f"tokenizer's {vocab_size} tokens")
        return arch
    fields = dataclasses.asdict(model.arch)
    fields["vocab_size"] = fields["vocab_size"] or vocab_size
    return ModelArch(**fields)


def params_dtype(cfg, role: str) -> torch.dtype:
    dtype = cfg.model_for(role).dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return DTYPES[dtype]


def recompute(cfg, role: str) -> dict | None:
    """The role's activation checkpointing (<role>.model.recompute_*) as models.gpt.build_gpt_model takes it."""
    model = cfg.model_for(role)
    if model.recompute_granularity is None:
        return None
    return {"granularity": model.recompute_granularity, **({"method": model.recompute_method,
            "num_layers": model.recompute_num_layers} if model.recompute_granularity == "full" else {})}
