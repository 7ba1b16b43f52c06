"""The roles table (megatron_ppo/roles.py) is the one definition of a role: every consumer agrees with it, and the
import rule of the house holds (workers, models and rollout never import the trainer)."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ppo import roles
from megatron_ppo.config import load_config
from megatron_ppo.config.schema import ModelConfig, ParallelConfig
from megatron_ppo.distributed import resolve_worker_class
from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.plan import Layout, Workload, memory, stage_params
from megatron_ppo.workers.role import RoleWorker

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("spec", roles.ROLES, ids=roles.NAMES)
def test_each_row_names_a_worker_a_model_config_and_a_layout(spec):
    cfg = load_config("tiny_cpu", [])
    worker = resolve_worker_class(spec.worker)
    assert worker.ROLE == spec.name  # the worker reads its row by this name
    assert isinstance(spec.own_model_config(cfg), ModelConfig), spec.model_key
    assert isinstance(getattr(cfg.cluster, spec.name), ParallelConfig)
    if spec.trainable:  # what a trainable role needs from its section and the trainer's
        assert hasattr(getattr(cfg, spec.name), "optim") and hasattr(getattr(cfg, spec.name), "ppo_epochs")
        assert isinstance(getattr(cfg.trainer, f"max_{spec.name}_ckpt_to_keep"), (int, type(None)))
        assert worker.update_inputs(cfg, {}) and worker.make_loss is not RoleWorker.make_loss  # its own loss


def test_enabled_roles_follow_the_config():
    def names(*overrides):
        return [r.name for r in roles.enabled(load_config("tiny_cpu", list(overrides)))]

    assert names("actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false") == ["actor", "critic"]
    assert names("actor.use_kl_loss=true") == ["actor", "critic", "ref"]
    assert names("algorithm.adv_estimator=grpo", "rollout.n=2", "actor.use_kl_loss=true") == ["actor", "ref"]
    cfg = load_config("tiny_cpu", ["actor.use_kl_loss=true"])
    assert cfg.roles == [r.name for r in roles.enabled(cfg)]
    assert [r.name for r in roles.trained(cfg)] == ["actor", "critic"]


def test_model_config_inheritance_is_the_tables():
    cfg = load_config("tiny_cpu", ["critic.model.dtype=bfloat16"])
    critic = roles.model_config(cfg, "critic")
    assert critic.arch == cfg.actor.model.arch and critic.dtype == "bfloat16"  # actor's weights, its own dtype
    assert roles.model_config(cfg, "ref").arch == cfg.actor.model.arch
    assert roles.model_config(cfg, "reward") is cfg.reward.reward_model.model  # never inherits a policy
    assert cfg.model_for("critic") == critic


def test_unknown_role_is_refused_naming_the_roles():
    with pytest.raises(ValueError, match=r"unknown role 'reference'; the roles are \['actor', 'critic', 'ref', "
                                         r"'reward'\]"):
        roles.spec("reference")


def test_the_planner_reads_trainable_and_head_from_the_table():
    """The reward model is frozen (no gradients, no optimizer state) and has a value head, as the table says."""
    arch, work = tiny_arch(), Workload(seq_len=16, micro_batch=1)
    for spec in roles.ROLES:
        mem = memory(arch, spec.name, Layout(), work)
        assert (mem.grads > 0) == spec.trainable and (mem.optimizer > 0) == spec.trainable, spec.name
        head = stage_params(arch, spec.name).head
        assert (head == arch.hidden_size) == spec.value_model, spec.name


def test_models_follow_the_table(megatron_single):
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.layers import ValueHead

    for spec in roles.ROLES:
        model = build_gpt_model(tiny_arch(), role=spec.name)
        assert isinstance(model.output_layer, ValueHead) == spec.value_model, spec.name
        assert all(p.requires_grad for p in model.parameters()) == spec.trainable, spec.name


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("package", ["workers", "models", "rollout"])
def test_nothing_below_the_trainer_imports_it(package):
    bad = {f"{path.relative_to(REPO)}: {name}" for path in (REPO / "megatron_ppo" / package).rglob("*.py")
           for name in _imports(path) if name == "megatron_ppo.trainer" or name.startswith("megatron_ppo.trainer.")}
    assert not bad, bad


def test_a_rank_never_loads_the_trainer():
    """What a rank imports to host any role's worker (and its rollout engine) loads no trainer module."""
    code = ("import sys\nfrom megatron_ppo import roles\nfrom megatron_ppo.distributed import resolve_worker_class\n"
            "for r in roles.ROLES: resolve_worker_class(r.worker)\nimport megatron_ppo.rollout.megatron\n"
            "print(sorted(m for m in sys.modules if m.startswith('megatron_ppo.trainer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_role_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        roles.spec("ref").trainable = True
