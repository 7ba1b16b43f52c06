"""verl's names for our config keys: the section map and exceptions behind the docs/config.md key table, and the
verl spellings (`actor_rollout_ref.actor.megatron`, `trainer.nnodes`, ...) that a config error translates.

Each field's own verl name is the third argument of `schema.field(...)` (`SAME`: the same name in the verl section
of its section); this module maps sections to verl sections and lists the keys that do not follow that rule.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import yaml

from .io import _default, _hints, _unwrap_optional, type_name
from .schema import SAME, PPOConfig


# verl's section for each of ours (docs table) and verl spellings that we accept nowhere but recognise in errors.
VERL_SECTIONS = {
    "data": "data", "data.preprocess": None,
    "actor": "actor_rollout_ref.actor", "actor.optim": "actor_rollout_ref.actor.optim",
    "actor.model": "actor_rollout_ref.model", "actor.model.arch": "hf_config",
    "critic": "critic", "critic.optim": "critic.optim", "critic.model": "critic.model",
    "critic.model.arch": "hf_config",
    "ref": "actor_rollout_ref.ref", "ref.model": "actor_rollout_ref.model", "ref.model.arch": "hf_config",
    "reward": "reward", "reward.custom_reward_function": "reward.custom_reward_function",
    "reward.reward_model": "reward.reward_model", "reward.reward_model.model": None,
    "reward.reward_model.model.arch": "hf_config",
    "rollout": "actor_rollout_ref.rollout", "rollout.val_kwargs": "actor_rollout_ref.rollout.val_kwargs",
    "algorithm": "algorithm", "algorithm.kl_ctrl": "algorithm.kl_ctrl", "algorithm.kl_guard": None,
    "algorithm.rollout_correction": "algorithm.rollout_correction",
    "trainer": "trainer", "global_profiler": "global_profiler", "cluster": "trainer",
    "cluster.actor": "actor_rollout_ref.actor.megatron", "cluster.critic": "critic.megatron",
    "cluster.ref": "actor_rollout_ref.ref.megatron", "cluster.reward": None,
}
_MEGATRON_MODEL_KEYS = {"dtype": "dtype", **{k: f"override_transformer_config.{k}" for k in
                                             ("recompute_granularity", "recompute_method", "recompute_num_layers")}}
VERL_KEYS = {  # rows whose verl key is not "<verl section>.<same name>"
    **{f"{ours}.model.{k}": f"{theirs}.megatron.{v}" for k, v in _MEGATRON_MODEL_KEYS.items()
       for ours, theirs in [("actor", "actor_rollout_ref.actor"), ("critic", "critic"), ("ref", "actor_rollout_ref.ref")]},
    "reward.reward_model.model.path": "reward.reward_model.model_path",
    "rollout.dump_dir": "trainer.rollout_data_dir", "trainer.seed": "actor_rollout_ref.actor.megatron.seed",
    "reward.reward_model.micro_batch_size_per_gpu": None,
    "cluster.nccl_timeout_s": "actor_rollout_ref.nccl_timeout",
}
VERL_RENAMES = [  # (verl's prefix, ours): an unknown-key error names our key (io._suggest)
    ("actor_rollout_ref.actor.megatron", "cluster.actor"), ("actor_rollout_ref.ref.megatron", "cluster.ref"),
    ("critic.megatron", "cluster.critic"), ("actor.megatron", "cluster.actor"), ("ref.megatron", "cluster.ref"),
    ("actor_rollout_ref.model", "actor.model"), ("actor_rollout_ref", ""), ("actor.grad_clip", "actor.optim.clip_grad"),
    ("critic.grad_clip", "critic.optim.clip_grad"), ("data.tokenizer", "actor.model.tokenizer_path"),
    ("trainer.nnodes", "cluster.nnodes"), ("trainer.n_gpus_per_node", "cluster.n_gpus_per_node"),
    ("trainer.device", "cluster.device"), ("trainer.rollout_data_dir", "rollout.dump_dir"),
    ("reward_model", "reward.reward_model"), ("custom_reward_function", "reward.custom_reward_function"),
    ("actor.optim.lr_scheduler_type", "actor.optim.lr_decay_style"),
    ("critic.optim.lr_scheduler_type", "critic.optim.lr_decay_style"),
]


# ---------------------------------------------------------------------------------------------- docs table

def _show_default(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("...") else text


def reference_rows(cls: type, verl_sections: dict[str, str | None], verl_keys: dict[str, str | None] | None = None,
                   prefix: str = "", instance: Any = None) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, verl key, help) for every leaf field, recursing into (optional) sub-sections.

    Defaults come from `instance` where a section's default is a configured instance (critic.optim.lr = 1e-5).
    The verl key is `verl_keys[key]` if listed, else the field's metadata resolved against its verl section.
    """
    verl_keys = verl_keys or {}
    rows = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        tp = _hints(cls)[f.name]
        inner = _unwrap_optional(tp)
        default = getattr(instance, f.name) if instance is not None else _default(f)
        if dataclasses.is_dataclass(inner):
            sub = default if dataclasses.is_dataclass(default) else None
            rows += reference_rows(inner, verl_sections, verl_keys, key + ".", sub)
            continue
        verl = f.metadata.get("verl", SAME)
        section = verl_sections.get(prefix.rstrip("."))
        if key in verl_keys:
            verl_key = verl_keys[key] or "—"
        elif verl is None or (verl == SAME and section is None):
            verl_key = "—"
        elif verl == SAME:
            verl_key = f"{section}.{f.name}"
        elif section is None:
            verl_key = verl
        else:
            verl_key = f"{section}.{verl}"
        shown = "(required)" if default is dataclasses.MISSING else _show_default(default)
        rows.append((key, type_name(tp), shown, verl_key, f.metadata.get("help", "")))
    return rows


def reference_table(cls: type, verl_sections: dict[str, str | None], verl_keys: dict[str, str | None]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| key | type | default | verl equivalent | meaning |", "|---|---|---|---|---|"]
    for key, tp, default, verl, help_text in reference_rows(cls, verl_sections, verl_keys):
        lines.append(f"| `{key}` | {cell(tp)} | `{cell(default)}` | {cell(verl if verl == '—' else f'`{verl}`')} "
                     f"| {cell(help_text)} |")
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The key table of docs/config.md, generated from the schema (a test keeps the docs in sync)."""
    return reference_table(PPOConfig, VERL_SECTIONS, VERL_KEYS)
