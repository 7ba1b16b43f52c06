"""The one table of roles: every model a run can build, defined once.

A role's ``name`` is used everywhere: its config section (``actor``, ``critic``, ``ref``, ``reward``), its layout
(``cluster.<name>``), its worker group, its checkpoint subdirectory and ``build_gpt_model(role=...)``. Groups,
components, preflight, the config checks, the planner and checkpointing read this table; nothing else lists roles.

Adding a role (a frozen teacher, a generative reward model) is one ``RoleSpec`` row here, its config section and
``cluster.<name>`` layout in config/schema.py, and one worker file (docs/trainer.md, "Adding a role").

Leaf module: no imports from the package at import time (config, models and workers all read it).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Callable, Literal


@dataclass(frozen=True)
class RoleSpec:
    name: str  # config section, cluster.<name>, worker group, checkpoint subdirectory, build_gpt_model role
    model_key: str  # dotted config path of the role's ModelConfig
    worker: str  # "package.module:Class" of the role's worker (built inside every rank)
    kind: Literal["lm", "value"]  # an LM head (log-probs over the vocabulary) or a scalar value head
    trainable: bool  # optimizer, lr schedule, checkpointed; frozen roles have none of these
    enabled: Callable[[object], bool]  # enabled(cfg): does this run build the role
    inherits_actor_model: bool = False  # without its own path/arch it takes the actor's weights source

    @property
    def value_model(self) -> bool:
        return self.kind == "value"

    def own_model_config(self, cfg):
        """The ModelConfig at ``model_key``, as written (no inheritance)."""
        return reduce(getattr, self.model_key.split("."), cfg)


ROLES: tuple[RoleSpec, ...] = (  # start order
    RoleSpec("actor", "actor.model", "megatron_ppo.workers.actor:ActorWorker", "lm", True, lambda cfg: True),
    RoleSpec("critic", "critic.model", "megatron_ppo.workers.critic:CriticWorker", "value", True,
             lambda cfg: cfg.use_critic, inherits_actor_model=True),
    RoleSpec("ref", "ref.model", "megatron_ppo.workers.ref:RefWorker", "lm", False,
             lambda cfg: cfg.use_reference, inherits_actor_model=True),
    RoleSpec("reward", "reward.reward_model.model", "megatron_ppo.workers.reward_model:RewardModelWorker", "value",
             False, lambda cfg: cfg.reward.reward_model.enable),
)
NAMES: tuple[str, ...] = tuple(r.name for r in ROLES)
_BY_NAME = {r.name: r for r in ROLES}


def spec(name: str) -> RoleSpec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; the roles are {list(NAMES)} (megatron_ppo/roles.py)") from None


def enabled(cfg) -> list[RoleSpec]:
    """The roles this run builds, in start order."""
    return [r for r in ROLES if r.enabled(cfg)]


def trained(cfg) -> list[RoleSpec]:
    """The enabled roles with an optimizer: what a checkpoint holds models and optimizer state of."""
    return [r for r in enabled(cfg) if r.trainable]


def model_config(cfg, name: str):
    """The role's ModelConfig; a role that inherits the actor's model and sets neither path nor arch gets the
    actor's weights source (path, arch, tokenizer) with its own dtype, recompute and GEMM settings."""
    role = spec(name)
    own = role.own_model_config(cfg)
    if not role.inherits_actor_model or own.path is not None or own.arch is not None:
        return own
    from megatron_ppo.config.schema import ModelConfig

    base = cfg.actor.model
    return ModelConfig(path=base.path, arch=base.arch, tokenizer_path=own.tokenizer_path or base.tokenizer_path,
                       dtype=own.dtype, recompute_granularity=own.recompute_granularity,
                       recompute_method=own.recompute_method, recompute_num_layers=own.recompute_num_layers,
                       cpu_gemm=own.cpu_gemm)
