"""algorithm.rollout_correction.bypass_mode / loss_type: accepted by the driver, bad values refused naming the key."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.checks import validate
from megatron_ppo.config.checks import unsupported_settings

KEY = "algorithm.rollout_correction"


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_is_accepted_with_either_loss_type(loss_type):
    cfg = load_config("tiny_cpu", [f"{KEY}.bypass_mode=true", f"{KEY}.loss_type={loss_type}",
                                   f"{KEY}.rollout_is=sequence", f"{KEY}.rollout_rs=token_k1",
                                   f"{KEY}.rollout_rs_threshold=2.0"])
    assert cfg.algorithm.rollout_correction.loss_type == loss_type
    assert unsupported_settings(cfg) == []


def test_loss_type_defaults_to_verls_ppo_clip():
    assert load_config("tiny_cpu").algorithm.rollout_correction.loss_type == "ppo_clip"


def test_unknown_loss_type_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=f"{KEY}.loss_type.*ppo_clip.*reinforce"):
        load_config("tiny_cpu", [f"{KEY}.bypass_mode=true", f"{KEY}.loss_type=vanilla"])
    cfg = load_config("tiny_cpu", [f"{KEY}.bypass_mode=true"])  # a config built in code, not from YAML
    rc = dataclasses.replace(cfg.algorithm.rollout_correction, loss_type="grpo")
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, rollout_correction=rc))
    with pytest.raises(ConfigError, match=f"{KEY}.loss_type: must be ppo_clip or reinforce, got 'grpo'"):
        validate(cfg)


def test_reinforce_without_bypass_mode_is_refused_naming_both_keys():
    """loss_type only selects the bypass-mode loss: reinforce with bypass_mode=false would be silently ignored."""
    with pytest.raises(ConfigError, match=f"{KEY}.loss_type: reinforce is only used with {KEY}.bypass_mode=true"):
        load_config("tiny_cpu", [f"{KEY}.loss_type=reinforce"])
