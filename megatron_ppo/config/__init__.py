"""Typed PPO configuration: nested dataclasses, YAML files, dotted CLI overrides, validation with clear errors.

    from megatron_ppo.config import load_config
    cfg = load_config("tiny_cpu", ["actor.clip_ratio=0.3", "algorithm.kl_ctrl.type=adaptive"])

The modules import one another in one direction only (a test checks it):
  schema       the dataclasses, `field` (default, help, verl name)          imports nothing of the package
  io           ConfigError, YAML, building from plain data, overrides       imports nothing of the package
  checks       value and cross-key rules (`validate`)                      schema, io
  verl_compat  verl's section names, renames, the docs/config.md key table  schema, io
  load         load_config / config_from_dict: read -> override -> build -> validate; CONFIG_DIR
This package re-exports what callers use.
"""
from .checks import validate
from .io import ConfigError, apply_overrides, from_dict, to_dict, yaml_dump, yaml_load
from .load import CONFIG_DIR, config_from_dict, load_config, resolve_config_path, save_config, to_yaml
from .schema import (KL_TYPES, LOGGERS, ROLLOUT_RS_OPTIONS, ActorConfig, AlgorithmConfig, ArchConfig, ClusterConfig,
                     CriticConfig, CustomRewardConfig, DataConfig, KLCtrlConfig, KLGuardConfig, KLPhase, KLType, Logger,
                     LossAggMode, ModelConfig, OptimConfig, ParallelConfig, PPOConfig, PreprocessConfig, RefConfig,
                     RewardConfig, RewardModelConfig, RolloutConfig, RolloutCorrectionConfig, SamplingConfig,
                     TrainerConfig, field)
from .verl_compat import VERL_KEYS, VERL_RENAMES, VERL_SECTIONS, reference_markdown, reference_rows, reference_table

__all__ = [
    "ConfigError", "PPOConfig", "load_config", "config_from_dict", "resolve_config_path", "from_dict", "to_dict",
    "to_yaml", "save_config", "validate", "apply_overrides", "yaml_load", "yaml_dump", "field", "CONFIG_DIR",
    "KL_TYPES", "LOGGERS", "ROLLOUT_RS_OPTIONS", "KLType", "LossAggMode", "Logger",
    "ActorConfig", "AlgorithmConfig", "ArchConfig", "ClusterConfig", "CriticConfig", "CustomRewardConfig",
    "DataConfig", "KLCtrlConfig", "KLGuardConfig", "KLPhase", "ModelConfig", "OptimConfig", "ParallelConfig",
    "PreprocessConfig", "RefConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig", "RolloutCorrectionConfig",
    "SamplingConfig", "TrainerConfig",
    "VERL_KEYS", "VERL_RENAMES", "VERL_SECTIONS", "reference_markdown", "reference_rows", "reference_table",
]
