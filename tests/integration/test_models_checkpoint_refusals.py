"""models/checkpoint.load_checkpoint refuses what would load wrongly: every refusal made to fire (issue 11: a check
without a test that makes it fire does not exist). Single process, a few seconds."""
from __future__ import annotations

import pytest

from megatron_ppo.models.arch import tiny_arch


def _build(role="actor", **arch):
    from megatron_ppo.models.gpt import build_gpt_model

    return build_gpt_model(tiny_arch(**arch), role=role)


@pytest.fixture
def saved_actor(megatron_single, tmp_path):
    from megatron_ppo.models.checkpoint import save_checkpoint

    save_checkpoint(_build(), str(tmp_path / "actor"))
    return str(tmp_path / "actor")


def test_a_directory_without_the_sidecar_is_not_a_checkpoint(megatron_single, tmp_path):
    from megatron_ppo.models.checkpoint import load_checkpoint

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a megatron_ppo model checkpoint"):
        load_checkpoint(_build(), str(tmp_path / "empty"))


def test_a_policy_checkpoint_does_not_load_into_a_value_model(saved_actor):
    from megatron_ppo.models.checkpoint import load_checkpoint

    with pytest.raises(ValueError, match="holds a actor model, cannot load into a critic"):
        load_checkpoint(_build("critic"), saved_actor)


def test_another_architecture_is_refused_naming_the_field(saved_actor):
    from megatron_ppo.models.checkpoint import load_checkpoint

    with pytest.raises(ValueError, match=r"architecture of .* differs .*num_layers"):
        load_checkpoint(_build(num_layers=3), saved_actor)


def test_asking_for_optimizer_state_that_was_not_saved_is_refused(saved_actor):
    from megatron_ppo.models.checkpoint import load_checkpoint
    from megatron_ppo.models.training import OptimizerSettings, build_optimizer, wrap_ddp

    model = _build()
    optimizer = build_optimizer(wrap_ddp(model), OptimizerSettings())
    with pytest.raises(ValueError, match="has no optimizer state"):
        load_checkpoint(model, saved_actor, optimizer)


def test_the_same_model_loads(saved_actor):
    """The refusals are not over-eager: the matching model loads and gets the saved meta back."""
    from megatron_ppo.models.checkpoint import load_checkpoint

    meta = load_checkpoint(_build(), saved_actor)
    assert meta["role"] == "actor" and meta["has_optimizer"] is False


def _with_optimizer(name: str):
    """A model with megatron's ``name`` optimizer (OptimizerConfig.optimizer), without the distributed optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ppo.models.training import wrap_ddp

    model = _build()
    return model, get_megatron_optimizer(OptimizerConfig(optimizer=name, lr=1e-2), [wrap_ddp(model)])


def test_sgd_is_refused_by_name_at_save_and_load(megatron_single, tmp_path):
    """megatron builds SGD only without the distributed optimizer (which asserts Adam); its sharded state dict has
    no state initialiser for a load (init_state_fn None): refused by name before anything is written or read."""
    from megatron_ppo.models.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer = _with_optimizer("sgd")
    with pytest.raises(ValueError, match=r"save_checkpoint: optimizer torch\.optim\.sgd\.SGD \(rank 0\) cannot be "
                                         r"checkpointed: .*supported: torch\.optim\.adam\.Adam"):
        save_checkpoint(model, str(tmp_path / "sgd"), optimizer)
    adam_model, adam = _with_optimizer("adam")
    save_checkpoint(adam_model, str(tmp_path / "adam"), adam)
    with pytest.raises(ValueError, match=r"load_checkpoint: optimizer torch\.optim\.sgd\.SGD"):
        load_checkpoint(model, str(tmp_path / "adam"), optimizer)
