"""Config: YAML round-trip, dotted overrides, the shipped configs, verl key/default parity, one test per rule."""
from __future__ import annotations

import dataclasses
import importlib.util
import typing
from pathlib import Path

import pytest
import yaml

from megatron_ppo import config as C
from megatron_ppo.config import CONFIG_DIR, ConfigError, PPOConfig, config_from_dict, load_config, to_dict, to_yaml
from megatron_ppo.config import reference_rows, yaml_load

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def _verl_trainer_yaml() -> dict:
    """verl 0.9.1's fully expanded Megatron PPO config, read as data (verl itself is not imported)."""
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    return yaml_load((root / "trainer/config/_generated_ppo_megatron_trainer.yaml").read_text())


# ---------------------------------------------------------------------------------------------- round-trip

def _rich_config() -> PPOConfig:
    """Exercises every value kind: nested sections, optional sections, lists of sections, dicts, unions."""
    return load_config("tiny_cpu", [
        "algorithm.kl_ctrl.type=phased",
        "algorithm.kl_ctrl.phases=[{until: 0.2, coef: 0.08}, {until: 0.8, coef: 0.05}, {until: 1.0, coef: 0.06}]",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
        "algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k3",
        "algorithm.rollout_correction.rollout_rs_threshold=0.8_1.25,0.01",
        "actor.model.arch.rope_scaling={rope_type: llama3, factor: 8.0}",
        "critic.model.arch.num_layers=4",
        "trainer.logger=[console, jsonl, tensorboard]",
    ])


@pytest.mark.parametrize("make", [PPOConfig, _rich_config, *[lambda p=p: load_config(p) for p in SHIPPED]],
                         ids=["defaults", "rich"] + [p.stem for p in SHIPPED])
def test_round_trip_dataclass_yaml_dataclass(make):
    cfg = make()
    text = to_yaml(cfg)
    back = C.from_dict(PPOConfig, yaml_load(text))
    assert back == cfg
    assert to_yaml(back) == text
    assert yaml.safe_load(text) == yaml_load(text) == to_dict(cfg)  # plain PyYAML reads our dump identically


def test_save_config_then_load_config_by_path(tmp_path):
    cfg = _rich_config()
    C.save_config(cfg, tmp_path / "sub" / "run.yaml")
    assert load_config(tmp_path / "sub" / "run.yaml") == cfg


def test_exponent_floats_without_a_dot_are_floats():
    # YAML 1.1 (PyYAML's default) reads "1e-6" as a string; our loader reads it as the number users mean.
    cfg = config_from_dict(yaml_load((CONFIG_DIR / "tiny_cpu.yaml").read_text()
                                     .replace("lr: 1.0e-2\n    clip_grad", "lr: 1e-6\n    clip_grad")))
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)


# ---------------------------------------------------------------------------------------------- overrides

def test_overrides_nested_typed_and_lists():
    cfg = load_config("tiny_cpu", [
        "actor.clip_ratio=0.3",
        "actor.optim.lr=3e-5",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=500",
        "actor.optim.betas=[0.8, 0.95]",
        "trainer.logger=[console, wandb]",
        "data.train_files=[a.parquet, b.parquet]",
        "actor.clip_ratio_high=0.28",
        "actor.clip_ratio_high=0.3",  # a later override wins
    ])
    assert cfg.actor.clip_ratio == 0.3 and cfg.actor.optim.lr == 3e-5
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.algorithm.kl_ctrl.horizon == 500
    assert cfg.actor.optim.betas == [0.8, 0.95] and cfg.trainer.logger == ["console", "wandb"]
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor.clip_bounds() == (0.3, 0.3)
    assert isinstance(cfg.algorithm.kl_ctrl.kl_coef, float)


@pytest.mark.parametrize("overrides,says", [
    (["actor.optim.lr", "1e-6"], "override 'actor.optim.lr' '1e-6': expected dotted.key=value without spaces: "
                                 "actor.optim.lr=1e-6"),
    (["data.train_files=a.parquet,b.parquet"], "data.train_files is a list: write it in brackets, "
                                               "data.train_files=[a.parquet,b.parquet]"),
    (["trainer.total_training_steps"], "override 'trainer.total_training_steps': expected dotted.key=value"),
])
def test_a_shell_habit_in_an_override_gets_the_fix_spelled_out(overrides, says):
    """`key value` (a space, no =) and a list without brackets: the error says what to type instead."""
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", overrides)
    assert says in str(exc.value)
    assert len(exc.value.errors) == 1  # one line for the pair, not one per word


def test_override_int_into_float_field_becomes_float():
    cfg = load_config("tiny_cpu", ["algorithm.gamma=1"])
    assert cfg.algorithm.gamma == 1.0 and type(cfg.algorithm.gamma) is float


def test_override_string_field_keeps_text_verbatim():
    cfg = load_config("tiny_cpu", ["trainer.experiment_name=2024", "trainer.project_name=1e3"])
    assert cfg.trainer.experiment_name == "2024" and cfg.trainer.project_name == "1e3"


def test_override_string_starting_with_a_hash_is_not_a_yaml_comment():
    """YAML reads a bare "#..." as a comment (null): rollout.stop_pattern=####... once became null, silently."""
    cfg = load_config("tiny_cpu", [r"rollout.stop_pattern=####[^\n]*\n", "trainer.experiment_name=#7"])
    assert cfg.rollout.stop_pattern == r"####[^\n]*\n" and cfg.trainer.experiment_name == "#7"
    for null in ("rollout.stop_pattern=null", "rollout.stop_pattern=~", "rollout.stop_pattern="):
        assert load_config("tiny_cpu", [r"rollout.stop_pattern=\d\n", null]).rollout.stop_pattern is None


def test_override_null_and_creating_an_optional_section():
    cfg = load_config("tiny_cpu", ["actor.clip_ratio_low=0.1", "actor.clip_ratio_low=null",
                                   "critic.model.arch.num_layers=4"])
    assert cfg.actor.clip_ratio_low is None
    assert cfg.critic.model.arch == C.ArchConfig(num_layers=4)  # a fresh inline arch with defaults
    assert cfg.model_for("critic").arch.num_layers == 4
    assert cfg.model_for("ref").arch == cfg.actor.model.arch  # ref still inherits the actor's


def test_override_into_free_form_dict_and_list_of_sections():
    cfg = load_config("tiny_cpu", ["actor.model.arch.rope_scaling.factor=8.0",
                                   "actor.model.arch.rope_scaling.rope_type=llama3",
                                   "algorithm.kl_ctrl.type=phased",
                                   "algorithm.kl_ctrl.phases=[{until: 0.5, coef: 0.1}, {until: 1, coef: 0.02}]"])
    assert cfg.actor.model.arch.rope_scaling == {"factor": 8.0, "rope_type": "llama3"}
    assert cfg.algorithm.kl_ctrl.phases == [C.KLPhase(0.5, 0.1), C.KLPhase(1.0, 0.02)]
    assert cfg.algorithm.kl_ctrl.phase_pairs() == [(0.5, 0.1), (1.0, 0.02)]


def test_overrides_do_not_mutate_the_input():
    data = yaml_load((CONFIG_DIR / "tiny_cpu.yaml").read_text())
    before = yaml.safe_dump(data)
    config_from_dict(data, ["actor.clip_ratio=0.1", "actor.model.arch.num_layers=4"])
    assert yaml.safe_dump(data) == before


def test_partial_section_keeps_that_sections_own_defaults():
    # critic.optim defaults to lr 1e-5 and val_kwargs to greedy; writing one other key must not reset them.
    cfg = load_config("tiny_cpu", ["critic.optim={clip_grad: 0.5}", "rollout.val_kwargs.top_p=0.9"])
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.clip_grad == 0.5
    assert cfg.rollout.val_kwargs == C.SamplingConfig(temperature=0.0, top_p=0.9, do_sample=False)


def test_load_by_bare_name_equals_load_by_path():
    assert load_config("tiny_cpu") == load_config(CONFIG_DIR / "tiny_cpu.yaml") == load_config()


# ---------------------------------------------------------------------------------------------- shipped configs

@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_yaml_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, PPOConfig)
    assert load_config(path.stem) == cfg


def test_shipped_configs_are_the_expected_ones():
    names = {p.stem for p in SHIPPED}
    assert "tiny_cpu" in names and any(n.startswith("gsm8k_") for n in names)


def test_gsm8k_config_carries_the_seed_recommended_values():
    cfg = load_config("gsm8k_ppo")
    a, al, d = cfg.actor, cfg.algorithm, cfg.data
    assert a.optim.lr == 1e-6 and a.clip_ratio == 0.2 and a.clip_ratio_c == 3.0
    assert a.kl_loss_type == "low_var_kl" and a.use_kl_loss is True and a.kl_loss_coef == 0.001
    assert al.gamma == 1.0 and al.lam == 1.0 and al.adv_estimator == "gae"
    assert d.train_batch_size == 1024 and a.ppo_mini_batch_size == 256 and a.ppo_epochs == 4
    assert a.optim.clip_grad == 1.0 and cfg.critic.optim.clip_grad == 1.0
    assert d.max_prompt_length == 512 and d.max_response_length == 512
    assert d.shuffle is True and d.seed == 42 and a.entropy_coeff == 0.0
    assert al.kl_guard.enable is True and al.kl_guard.target_kl == 0.1
    assert cfg.use_critic and cfg.use_reference


def test_tiny_cpu_is_tiny_and_points_at_the_real_gsm8k_files():
    cfg = load_config("tiny_cpu")
    arch = cfg.actor.model.arch
    assert (arch.num_layers, arch.hidden_size) == (2, 64)
    assert cfg.cluster.device == "cpu" and cfg.cluster.world_size <= 2 and cfg.actor.model.dtype == "float32"
    assert cfg.trainer.total_training_steps is not None and cfg.trainer.total_training_steps <= 40  # minutes on 2 cores
    from megatron_ppo.data.gsm8k import default_gsm8k_dir

    assert cfg.data.preprocess.input_dir is None  # the data area's default location: the real files
    raw = default_gsm8k_dir()
    assert (raw / "train.jsonl").is_file() and (raw / "test.jsonl").is_file()
    out = Path(cfg.data.preprocess.output_dir)
    assert not out.is_absolute() and out.parts[0] == "outputs"
    assert [Path(f).name for f in cfg.data.train_files + cfg.data.val_files] == ["train.parquet", "test.parquet"]
    assert all(Path(f).parent == out for f in cfg.data.train_files + cfg.data.val_files)  # where preprocess writes
    assert cfg.data.preprocess.build_tokenizer and cfg.actor.model.tokenizer_path is None
    assert cfg.model_for("critic").arch == arch and cfg.model_for("ref").arch == arch


def test_tiny_cpu_reward_and_data_sections_feed_the_data_area():
    from megatron_ppo.data.prompt_dataset import overlong_policy_from_verl
    from megatron_ppo.rewards.batch import RewardScorer

    cfg = load_config("tiny_cpu")
    assert overlong_policy_from_verl(cfg.data.filter_overlong_prompts, cfg.data.truncation) == "filter"
    for truncation in ("error", "left", "right"):  # every value the config allows is one the dataset accepts
        overlong_policy_from_verl(False, truncation)
    scorer = RewardScorer.from_config(cfg.reward, cfg.data.max_response_length)
    out = scorer(["so the answer is #### 72", "#### 71"], ["openai/gsm8k"] * 2, ["72", "72"])
    assert [float(x) for x in out.scores] == [1.0, cfg.reward.format_score]  # a wrong number earns the format score


# ---------------------------------------------------------------------------------------------- schema parity

def test_arch_fields_are_the_contracts_model_arch_fields():
    contract = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "max_position_embeddings", "rotary_base", "rope_scaling", "norm_epsilon",
                "add_qkv_bias", "tie_word_embeddings", "normalization", "activation"]
    assert [f.name for f in dataclasses.fields(C.ArchConfig)] == contract
    if importlib.util.find_spec("megatron_ppo.models.arch") is not None:  # once the models area has landed
        from megatron_ppo.models.arch import ModelArch

        assert {f.name for f in dataclasses.fields(ModelArch)} >= set(contract)


def test_enums_match_what_the_algo_code_accepts():
    from megatron_ppo.algo import kl_control, losses, rollout_correction

    assert set(C.LossAggMode.__args__) == set(losses.AGG_LOSS_MODES)
    assert set(C.ROLLOUT_RS_OPTIONS) == set(rollout_correction.RS_OPTIONS)
    assert set(typing.get_type_hints(C.KLCtrlConfig)["type"].__args__) == set(kl_control.KL_CONTROLLER_TYPES)
    assert set(typing.get_type_hints(C.RolloutCorrectionConfig)["rollout_is"].__args__[0].__args__) == set(
        rollout_correction.IS_LEVELS)
    bases = {t.rstrip("+") for t in C.KL_TYPES}
    assert bases == set(losses.KL_PENALTY_TYPES) and all(t + "+" in C.KL_TYPES for t in bases)
    import torch

    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    for kl_type in C.KL_TYPES:  # every accepted config value runs through the real estimator
        assert torch.isfinite(losses.kl_penalty(logp, ref, kl_type)).all()


def test_phased_config_builds_the_algo_controller():
    from megatron_ppo.algo.kl_control import build_kl_controller

    cfg = _rich_config()
    k = cfg.algorithm.kl_ctrl
    ctrl = build_kl_controller(type=k.type, kl_coef=k.kl_coef, phases=k.phase_pairs(), total_steps=10)
    assert [ctrl.value_at(s) for s in (0, 1, 2, 5, 9)] == [0.08, 0.08, 0.05, 0.05, 0.06]


def _verl_lookup(tree: dict, key: str):
    """Value at a dotted verl key; an interpolated (`${...}`) parent counts as present."""
    node = tree
    for part in key.split("."):
        if isinstance(node, str) and node.startswith("${"):
            return node
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def test_every_verl_equivalent_in_the_docs_is_a_real_verl_key():
    import transformers

    verl = _verl_trainer_yaml()
    verl["hf_config"] = transformers.LlamaConfig().to_dict()  # arch keys name the HF config.json fields
    rows = reference_rows(PPOConfig, C.VERL_SECTIONS, C.VERL_KEYS)
    missing = [(key, verl_key) for key, _, _, verl_key, _ in rows if verl_key != "—"
               and not _has(verl, verl_key)]
    assert missing == []
    same_name = sum(1 for key, *_, verl_key, _ in rows if verl_key.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1])
    assert same_name >= 100  # most keys keep verl's spelling


def _has(tree, key):
    try:
        _verl_lookup(tree, key)
        return True
    except KeyError:
        return False


# Defaults that differ from verl 0.9.1 on purpose (docs/config.md explains each).
DELIBERATE_DEFAULT_DIFFERENCES = {
    "data.train_files", "data.val_files",  # verl ships example paths
    "actor.model.path", "critic.model.path", "ref.model.path",
    "data.seed",  # verl: null; a reproducible 42
    "actor.clip_ratio_low", "actor.clip_ratio_high",  # null = clip_ratio (verl's 0.2 silently shadows clip_ratio)
    "actor.model.dtype", "critic.model.dtype", "ref.model.dtype",  # auto: bf16 on GPU, fp32 on CPU
    "cluster.device",  # auto instead of cuda: CPU runs
    "cluster.actor.sequence_parallel", "cluster.critic.sequence_parallel", "cluster.ref.sequence_parallel",
    "trainer.project_name", "trainer.experiment_name", "trainer.logger",
    "trainer.default_local_dir",  # same directory; {project_name} placeholders instead of ${trainer.*} interpolation
    "cluster.nccl_timeout_s",  # 1800 s, verl's 600: a synchronous 70B checkpoint save outlasts 10 minutes (issue 47)
    "rollout.vllm.bucket_mb",  # 512, verl's 2048: the extra memory a sync holds beside a colocated actor (issue 48)
    "global_profiler.save_path",  # null = <trainer.log_dir>/profile, beside the run's metrics; verl: outputs/profile
}


def test_defaults_equal_verls_except_the_documented_differences():
    verl = _verl_trainer_yaml()
    different = set()
    for key, _, default, verl_key, _ in reference_rows(PPOConfig, C.VERL_SECTIONS, C.VERL_KEYS):
        if verl_key == "—" or verl_key.startswith("hf_config."):
            continue
        theirs = _verl_lookup(verl, verl_key)
        if isinstance(theirs, str) and (theirs.startswith("${") or theirs == "???"):
            continue  # interpolated in verl
        if yaml_load(default) != theirs:
            different.add(key)
    assert different == DELIBERATE_DEFAULT_DIFFERENCES


def test_docs_key_table_is_generated_from_the_schema():
    import subprocess
    import sys

    docs = (REPO / "docs" / "config.md").read_text()
    # a fresh interpreter: the table of the schema as shipped (a test earlier in this process may have mutated a
    # default in place)
    table = subprocess.run([sys.executable, "-c", "import sys, megatron_ppo.config as C; "
                            "sys.stdout.write(C.reference_markdown())"], capture_output=True, text=True,
                           check=True, cwd=REPO).stdout
    assert table in docs, "docs/config.md is stale: paste megatron_ppo.config.reference_markdown()"


def test_derived_properties():
    cfg = load_config("tiny_cpu", ["algorithm.adv_estimator=grpo", "rollout.n=2", "actor.use_kl_loss=false"])
    assert not cfg.use_critic and not cfg.use_reference
    cfg = load_config("tiny_cpu", ["critic.enable=true", "algorithm.adv_estimator=grpo", "rollout.n=2"])
    assert cfg.use_critic
    t = load_config("gsm8k_ppo").trainer
    assert t.expand(t.default_local_dir) == "checkpoints/megatron_ppo/gsm8k_ppo"


# ---------------------------------------------------------------------------------------------- one test per rule

TINY_OVERRIDES_FOR_GRPO = ["algorithm.adv_estimator=grpo", "rollout.n=2"]

# (id, base config, overrides, substrings that the error message must contain)
RULES = [
    # structure: unknown keys, types, enums
    ("unknown_key", "tiny_cpu", ["actor.clip_rato=0.2"], ["actor.clip_rato: unknown key", "'actor.clip_ratio'"]),
    ("unknown_key_in_other_section", "tiny_cpu", ["actor.gamma=0.9"], ["actor.gamma", "'algorithm.gamma'"]),
    ("verl_spelling", "tiny_cpu", ["actor.grad_clip=1.0"], ["actor.grad_clip", "'actor.optim.clip_grad'"]),
    ("verl_prefix", "tiny_cpu", ["actor_rollout_ref.actor.clip_ratio=0.1"], ["here it is 'actor.clip_ratio'"]),
    ("verl_trainer_nnodes", "tiny_cpu", ["trainer.nnodes=2"], ["'cluster.nnodes'"]),
    ("heap_release_fraction", "tiny_cpu", ["cluster.release_heap_below_available=1.0"],
     ["cluster.release_heap_below_available: must be a fraction in [0, 1) (0: never), got 1.0"]),
    ("nccl_timeout_positive", "tiny_cpu", ["cluster.nccl_timeout_s=0"], ["cluster.nccl_timeout_s: must be > 0, got 0"]),
    # a GPU config that raised collective_timeout_s to cover its saves: on GPUs nccl_timeout_s is the one that counts
    ("nccl_timeout_below_backstop", "gsm8k_ppo", ["cluster.collective_timeout_s=3600"],
     ["cluster.nccl_timeout_s: 1800 s is shorter than cluster.collective_timeout_s (3600 s)", "at least 3600"]),
    ("override_syntax", "tiny_cpu", ["actor.clip_ratio"], ["'actor.clip_ratio'", "dotted.key=value"]),
    ("override_below_a_scalar", "tiny_cpu", ["actor.clip_ratio.low=1"], ["actor.clip_ratio is a float"]),
    ("override_bad_yaml", "tiny_cpu", ["trainer.logger=[console"], ["trainer.logger", "not valid YAML"]),
    ("wrong_type_float", "tiny_cpu", ["actor.clip_ratio=abc"], ["actor.clip_ratio: expected float, got str"]),
    ("wrong_type_bool", "tiny_cpu", ["actor.use_kl_loss=1"], ["actor.use_kl_loss: expected bool, got int"]),
    ("wrong_type_int", "tiny_cpu", ["data.train_batch_size=8.5"], ["data.train_batch_size: expected int"]),
    ("null_for_required_value", "tiny_cpu", ["actor.clip_ratio=null"], ["actor.clip_ratio: expected float, got null"]),
    ("scalar_for_section", "tiny_cpu", ["actor.optim=3"], ["actor.optim: expected a mapping"]),
    ("list_item_type", "tiny_cpu", ["actor.optim.betas=[0.9, x]"], ["actor.optim.betas[1]: expected float"]),
    ("enum_adv_estimator", "tiny_cpu", ["algorithm.adv_estimator=ppo"],
     ["algorithm.adv_estimator: must be one of ['gae', 'grpo'], got 'ppo'"]),
    ("enum_kl_loss_type", "tiny_cpu", ["actor.kl_loss_type=k4"], ["actor.kl_loss_type", "'low_var_kl'", "'k4'"]),
    ("enum_kl_penalty", "tiny_cpu", ["algorithm.kl_penalty=full"], ["algorithm.kl_penalty", "'k3+'"]),
    ("enum_loss_agg_mode", "tiny_cpu", ["actor.loss_agg_mode=mean"], ["actor.loss_agg_mode", "'seq-mean-token-mean'"]),
    ("enum_kl_ctrl_type", "tiny_cpu", ["algorithm.kl_ctrl.type=linear"],
     ["algorithm.kl_ctrl.type", "['fixed', 'adaptive', 'phased']"]),
    ("enum_logger", "tiny_cpu", ["trainer.logger=[console, mlflow]"], ["trainer.logger[1]", "'swanlab'", "'mlflow'"]),
    ("enum_rollout_mode", "tiny_cpu", ["rollout.mode=async"], ["rollout.mode", "['online', 'offline']"]),
    ("enum_rollout_is", "tiny_cpu", ["algorithm.rollout_correction.rollout_is=seq"],
     ["algorithm.rollout_correction.rollout_is", "['token', 'sequence']"]),
    ("enum_truncation", "tiny_cpu", ["data.truncation=middle"], ["data.truncation", "['error', 'left', 'right']"]),
    ("enum_lr_decay_style", "tiny_cpu", ["actor.optim.lr_decay_style=wsd"],
     ["actor.optim.lr_decay_style", "['constant', 'linear', 'cosine']"]),
    ("enum_reward_method", "tiny_cpu", ["reward.method=flexible"], ["reward.method", "['strict', 'numeric']"]),
    ("enum_dtype", "tiny_cpu", ["actor.model.dtype=fp8"], ["actor.model.dtype", "'bfloat16'"]),
    ("phase_missing_key", "tiny_cpu", ["algorithm.kl_ctrl.type=phased", "algorithm.kl_ctrl.phases=[{until: 1.0}]"],
     ["algorithm.kl_ctrl.phases[0].coef: required key is missing"]),
    # trainer.async_rollout=one_step: only where generation can overlap training
    ("one_step_megatron_engine", "tiny_cpu", ["trainer.async_rollout=one_step"],
     ["trainer.async_rollout: one_step needs rollout.name=vllm, got 'megatron'", "nothing could overlap"]),
    ("one_step_offline", "tiny_cpu", ["trainer.async_rollout=one_step", "rollout.name=vllm", "rollout.mode=offline",
                                      "rollout.trajectory_files=[t.parquet]", "data.train_files=[]"],
     ["trainer.async_rollout: one_step overlaps generation with training; rollout.mode=offline generates nothing"]),
    ("vllm_cpu_threads_bind", "tiny_cpu", ["rollout.name=vllm", "rollout.vllm.cpu_threads_bind=core0"],
     ["rollout.vllm.cpu_threads_bind: must list cores like '0', '0-3' or '0,2-3', got 'core0'"]),
    ("max_staleness_two", "tiny_cpu", ["trainer.max_staleness=2"], ["trainer.max_staleness: must be 0 or 1", "got 2"]),
    # actor
    ("clip_ratio_c_not_above_1", "tiny_cpu", ["actor.clip_ratio_c=1.0"], ["actor.clip_ratio_c: must be > 1.0", "1.0"]),
    ("clip_ratio_range", "tiny_cpu", ["actor.clip_ratio=1.5"], ["actor.clip_ratio: must be in (0, 1), got 1.5"]),
    ("clip_ratio_low_range", "tiny_cpu", ["actor.clip_ratio_low=0"], ["actor.clip_ratio_low: must be in (0, 1)"]),
    ("clip_ratio_high_positive", "tiny_cpu", ["actor.clip_ratio_high=-0.1"], ["actor.clip_ratio_high: must be > 0"]),
    ("mini_batch_divides_train_batch", "tiny_cpu", ["actor.ppo_mini_batch_size=3"],
     ["actor.ppo_mini_batch_size: must divide data.train_batch_size (16), got 3"]),
    ("critic_mini_batch_divides_train_batch", "tiny_cpu", ["critic.ppo_mini_batch_size=5"],
     ["critic.ppo_mini_batch_size: must divide data.train_batch_size (16), got 5"]),
    ("mini_batch_positive", "tiny_cpu", ["actor.ppo_mini_batch_size=0"], ["actor.ppo_mini_batch_size: must be > 0"]),
    ("micro_batch_required", "tiny_cpu", ["actor.ppo_micro_batch_size_per_gpu=null"],
     ["actor.ppo_micro_batch_size_per_gpu: required unless use_dynamic_bsz"]),
    ("micro_batch_divides_mini_batch", "tiny_cpu", ["actor.ppo_micro_batch_size_per_gpu=3"],
     ["actor.ppo_micro_batch_size_per_gpu: must divide the per-rank mini-batch (8 sequences), got 3"]),
    ("micro_batch_zero", "tiny_cpu", ["critic.ppo_micro_batch_size_per_gpu=0"],
     ["critic.ppo_micro_batch_size_per_gpu: must be > 0, got 0"]),
    ("mini_batch_splits_over_dp", "tiny_cpu", ["cluster.n_gpus_per_node=16"],
     ["critic.ppo_mini_batch_size: 8 prompts x rollout.n 1 = 8 sequences must split evenly over 16"]),
    ("dynamic_token_budget_fits_a_sequence", "tiny_cpu",
     ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100"],
     ["actor.ppo_max_token_len_per_gpu: must hold one full sequence", "(136)", "got 100"]),
    ("ref_micro_batch_required", "tiny_cpu", ["ref.log_prob_micro_batch_size_per_gpu=null"],
     ["ref.log_prob_micro_batch_size_per_gpu: required unless"]),
    ("rollout_micro_batch_required", "tiny_cpu", ["rollout.log_prob_micro_batch_size_per_gpu=null"],
     ["rollout.log_prob_micro_batch_size_per_gpu: required unless"]),
    ("ppo_epochs_positive", "tiny_cpu", ["actor.ppo_epochs=0"], ["actor.ppo_epochs: must be > 0, got 0"]),
    ("negative_lr", "tiny_cpu", ["actor.optim.lr=-1e-6"], ["actor.optim.lr: must be >= 0, got -1e-06"]),
    ("negative_critic_lr", "tiny_cpu", ["critic.optim.lr=-1"], ["critic.optim.lr: must be >= 0"]),
    ("min_lr_above_lr", "tiny_cpu", ["actor.optim.lr_decay_style=cosine", "actor.optim.min_lr=1.0"],
     ["actor.optim.min_lr: must be <= actor.optim.lr (0.01), got 1.0"]),
    ("min_lr_negative", "tiny_cpu", ["actor.optim.lr_decay_style=cosine", "actor.optim.min_lr=-1e-6"],
     ["actor.optim.min_lr: must be >= 0, got -1e-06"]),
    ("warmup_ratio_range", "tiny_cpu", ["actor.optim.lr_warmup_steps_ratio=1.5"],
     ["actor.optim.lr_warmup_steps_ratio: must be in [0, 1]"]),
    ("lr_decay_steps_positive", "tiny_cpu", ["actor.optim.lr_decay_steps=0"], ["actor.optim.lr_decay_steps: must be > 0"]),
    ("betas_range", "tiny_cpu", ["actor.optim.betas=[0.9, 1.0]"], ["actor.optim.betas: must be two numbers in [0, 1)"]),
    ("negative_weight_decay", "tiny_cpu", ["actor.optim.weight_decay=-0.1"], ["actor.optim.weight_decay: must be >= 0"]),
    ("negative_clip_grad", "tiny_cpu", ["actor.optim.clip_grad=-1"], ["actor.optim.clip_grad: must be >= 0"]),
    ("negative_warmup_init", "tiny_cpu", ["actor.optim.lr_warmup_init=-1"], ["actor.optim.lr_warmup_init: must be >= 0"]),
    ("negative_entropy_coeff", "tiny_cpu", ["actor.entropy_coeff=-0.01"], ["actor.entropy_coeff: must be >= 0"]),
    ("entropy_chunk_positive", "tiny_cpu", ["actor.entropy_from_logits_chunk_size=0"],
     ["actor.entropy_from_logits_chunk_size: must be > 0"]),
    ("negative_kl_loss_coef", "tiny_cpu", ["actor.kl_loss_coef=-1"], ["actor.kl_loss_coef: must be >= 0"]),
    ("loss_scale_factor_needs_norm_mode", "tiny_cpu", ["actor.loss_scale_factor=512"],
     ["actor.loss_scale_factor: only used with loss_agg_mode=seq-mean-token-sum-norm"]),
    ("loss_scale_factor_positive", "tiny_cpu",
     ["actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=0"], ["actor.loss_scale_factor: must be > 0"]),
    # critic
    ("critic_off_with_gae", "tiny_cpu", ["critic.enable=false"],
     ["critic.enable: must not be false with algorithm.adv_estimator=gae"]),
    ("cliprange_value_positive", "tiny_cpu", ["critic.cliprange_value=0"], ["critic.cliprange_value: must be > 0"]),
    ("critic_warmup_without_critic", "tiny_cpu", TINY_OVERRIDES_FOR_GRPO + ["trainer.critic_warmup=2"],
     ["trainer.critic_warmup: must be 0 without a critic"]),
    # models
    ("actor_model_missing", "tiny_cpu", ["actor.model.arch=null"],
     ["actor.model: set path (HF model directory) or arch"]),
    ("model_path_and_arch", "tiny_cpu", ["actor.model.path=models/x"], ["actor.model: set either path", "not both"]),
    ("inline_arch_needs_tokenizer", "tiny_cpu", ["data.preprocess.build_tokenizer=false"],
     ["actor.model.tokenizer_path: required when actor.model.arch is inline"]),
    ("built_tokenizer_or_a_path", "tiny_cpu", ["actor.model.tokenizer_path=tok/"],
     ["actor.model.tokenizer_path: must be null with data.preprocess.build_tokenizer=true"]),
    ("reward_model_needs_a_model", "tiny_cpu", ["reward.reward_model.enable=true"],
     ["reward.reward_model.model: set path or arch"]),
    ("reward_model_micro_batch_positive", "tiny_cpu", ["reward.reward_model.micro_batch_size_per_gpu=0"],
     ["reward.reward_model.micro_batch_size_per_gpu: must be > 0"]),
    ("arch_hidden_divisible_by_heads", "tiny_cpu", ["actor.model.arch.hidden_size=66"],
     ["actor.model.arch.hidden_size: must be divisible by num_attention_heads (4), got 66"]),
    ("arch_heads_divisible_by_groups", "tiny_cpu", ["actor.model.arch.num_query_groups=3"],
     ["actor.model.arch.num_query_groups: must divide num_attention_heads (4), got 3"]),
    ("arch_positive", "tiny_cpu", ["actor.model.arch.num_layers=0"], ["actor.model.arch.num_layers: must be > 0"]),
    ("arch_vocab_positive", "tiny_cpu", ["actor.model.arch.vocab_size=0"], ["actor.model.arch.vocab_size: must be > 0"]),
    ("arch_norm_epsilon_positive", "tiny_cpu", ["actor.model.arch.norm_epsilon=0"],
     ["actor.model.arch.norm_epsilon: must be > 0"]),
    ("arch_rotary_base_positive", "tiny_cpu", ["actor.model.arch.rotary_base=0"],
     ["actor.model.arch.rotary_base: must be > 0"]),
    ("arch_positions_fit_sequences", "tiny_cpu", ["actor.model.arch.max_position_embeddings=128"],
     ["actor.model.arch.max_position_embeddings: must be >= data.max_prompt_length + data.max_response_length (136)"]),
    ("arch_heads_split_over_tp", "tiny_cpu", ["cluster.n_gpus_per_node=4", "cluster.actor.tensor_model_parallel_size=4"],
     ["actor.model.arch.num_query_groups: must be divisible by cluster.actor.tensor_model_parallel_size (4), got 2"]),
    ("arch_layers_split_over_pp", "tiny_cpu", ["cluster.n_gpus_per_node=4", "cluster.actor.pipeline_model_parallel_size=4"],
     ["actor.model.arch.num_layers: must be divisible by cluster.actor.pipeline_model_parallel_size (4), got 2"]),
    ("inherited_arch_checked_for_the_critic_layout", "tiny_cpu",
     ["cluster.n_gpus_per_node=4", "cluster.critic.tensor_model_parallel_size=4", "actor.ppo_micro_batch_size_per_gpu=1"],
     ["actor.model.arch.num_query_groups: must be divisible by cluster.critic.tensor_model_parallel_size (4)"]),
    ("recompute_full_needs_method", "tiny_cpu", ["actor.model.recompute_granularity=full"],
     ["actor.model.recompute_method: required with recompute_granularity=full", "['uniform', 'block']"]),
    ("recompute_full_needs_layers", "tiny_cpu",
     ["actor.model.recompute_granularity=full", "actor.model.recompute_method=uniform"],
     ["actor.model.recompute_num_layers: must be >= 1 with recompute_granularity=full"]),
    ("recompute_method_without_full", "tiny_cpu", ["critic.model.recompute_method=block"],
     ["critic.model.recompute_method: only used with recompute_granularity=full"]),
    # data
    ("train_files_required_online", "tiny_cpu", ["data.train_files=[]"], ["data.train_files: required when rollout.mode=online"]),
    ("empty_file_path", "tiny_cpu", ["data.val_files=['']"], ["data.val_files[0]: must be a file path"]),
    ("max_prompt_length_positive", "tiny_cpu", ["data.max_prompt_length=0"], ["data.max_prompt_length: must be > 0"]),
    ("max_response_length_positive", "tiny_cpu", ["data.max_response_length=-1"], ["data.max_response_length: must be > 0"]),
    ("train_batch_size_positive", "tiny_cpu", ["data.train_batch_size=0"], ["data.train_batch_size: must be > 0"]),
    ("val_batch_size_positive", "tiny_cpu", ["data.val_batch_size=0"], ["data.val_batch_size: must be > 0"]),
    ("max_samples", "tiny_cpu", ["data.train_max_samples=0"], ["data.train_max_samples: must be -1 (all) or >= 1"]),
    ("val_max_samples", "tiny_cpu", ["data.val_max_samples=-5"], ["data.val_max_samples: must be -1 (all) or >= 1"]),
    ("prompt_key_empty", "tiny_cpu", ["data.prompt_key=''"], ["data.prompt_key: must be a column name"]),
    ("reward_fn_key_empty", "tiny_cpu", ["data.reward_fn_key=''"], ["data.reward_fn_key: must be a column name"]),
    ("preprocess_needs_output_dir", "tiny_cpu", ["data.preprocess.output_dir=null"],
     ["data.preprocess.output_dir: required with data.preprocess.dataset or data.preprocess.build_tokenizer"]),
    ("tokenizer_vocab_too_small", "tiny_cpu", ["data.preprocess.tokenizer_vocab_size=100"],
     ["data.preprocess.tokenizer_vocab_size: must be >= 256"]),
    # rollout
    ("stop_pattern_syntax", "tiny_cpu", ["rollout.stop_pattern=([0-9]"],
     ["rollout.stop_pattern='([0-9]': not a valid regular expression"]),
    ("stop_pattern_empty_match", "tiny_cpu", ["rollout.stop_pattern=#*"],
     ["rollout.stop_pattern='#*': matches empty text"]),
    ("grpo_needs_groups", "tiny_cpu", ["algorithm.adv_estimator=grpo"], ["rollout.n: must be >= 2 with algorithm.adv_estimator=grpo"]),
    ("temperature_zero_when_sampling", "tiny_cpu", ["rollout.temperature=0"],
     ["rollout.temperature: must be > 0 when do_sample is true"]),
    ("val_temperature_negative", "tiny_cpu", ["rollout.val_kwargs.temperature=-1"],
     ["rollout.val_kwargs.temperature: must be >= 0"]),
    ("top_p_range", "tiny_cpu", ["rollout.top_p=0"], ["rollout.top_p: must be in (0, 1]"]),
    ("top_k_zero", "tiny_cpu", ["rollout.top_k=0"], ["rollout.top_k: must be -1 (off) or >= 1, got 0"]),
    ("n_positive", "tiny_cpu", ["rollout.n=0"], ["rollout.n: must be > 0"]),
    ("offline_needs_trajectories", "tiny_cpu", ["rollout.mode=offline"],
     ["rollout.trajectory_files: required when rollout.mode=offline"]),
    ("online_ignores_trajectories", "tiny_cpu", ["rollout.trajectory_files=[t.parquet]"],
     ["rollout.trajectory_files: only read when rollout.mode=offline"]),
    # algorithm
    ("gamma_range", "tiny_cpu", ["algorithm.gamma=1.1"], ["algorithm.gamma: must be in [0, 1], got 1.1"]),
    ("lam_range", "tiny_cpu", ["algorithm.lam=-0.1"], ["algorithm.lam: must be in [0, 1]"]),
    ("kl_coef_negative", "tiny_cpu", ["algorithm.kl_ctrl.kl_coef=-0.1"], ["algorithm.kl_ctrl.kl_coef: must be >= 0"]),
    ("kl_horizon_positive", "tiny_cpu", ["algorithm.kl_ctrl.horizon=0"], ["algorithm.kl_ctrl.horizon: must be > 0"]),
    ("kl_target_positive", "tiny_cpu", ["algorithm.kl_ctrl.target_kl=0"], ["algorithm.kl_ctrl.target_kl: must be > 0"]),
    ("phased_needs_phases", "tiny_cpu", ["algorithm.kl_ctrl.type=phased"],
     ["algorithm.kl_ctrl.phases: required with algorithm.kl_ctrl.type=phased"]),
    ("phases_increasing", "tiny_cpu",
     ["algorithm.kl_ctrl.type=phased", "algorithm.kl_ctrl.phases=[{until: 0.5, coef: 0.1}, {until: 0.5, coef: 0.1}, "
      "{until: 1.0, coef: 0.1}]"],
     ["algorithm.kl_ctrl.phases[1].until: must increase strictly within (0, 1]: previous 0.5, got 0.5"]),
    ("phases_end_at_one", "tiny_cpu",
     ["algorithm.kl_ctrl.type=phased", "algorithm.kl_ctrl.phases=[{until: 0.2, coef: 0.08}, {until: 0.9, coef: 0.05}]"],
     ["algorithm.kl_ctrl.phases[1].until: the last phase must end at 1.0", "got 0.9"]),
    ("phases_coef_negative", "tiny_cpu", ["algorithm.kl_ctrl.type=phased", "algorithm.kl_ctrl.phases=[{until: 1, coef: -1}]"],
     ["algorithm.kl_ctrl.phases[0].coef: must be >= 0"]),
    ("phases_without_phased_type", "tiny_cpu", ["algorithm.kl_ctrl.phases=[{until: 1.0, coef: 0.1}]"],
     ["algorithm.kl_ctrl.phases: only used with algorithm.kl_ctrl.type=phased (it is fixed)"]),
    ("kl_guard_target_positive", "tiny_cpu", ["algorithm.kl_guard.target_kl=0"], ["algorithm.kl_guard.target_kl: must be > 0"]),
    ("is_threshold_positive", "tiny_cpu", ["algorithm.rollout_correction.rollout_is_threshold=0"],
     ["algorithm.rollout_correction.rollout_is_threshold: must be > 0"]),
    ("is_threshold_syntax", "tiny_cpu", ["algorithm.rollout_correction.rollout_is_threshold=0.5_x"],
     ["algorithm.rollout_correction.rollout_is_threshold", "'0.5_x'"]),
    ("is_batch_normalize_without_is", "tiny_cpu", ["algorithm.rollout_correction.rollout_is_batch_normalize=true"],
     ["algorithm.rollout_correction.rollout_is_batch_normalize: only used when"]),
    ("rs_option_unknown", "tiny_cpu", ["algorithm.rollout_correction.rollout_rs=token_k9",
                                       "algorithm.rollout_correction.rollout_rs_threshold=2"],
     ["algorithm.rollout_correction.rollout_rs", "'token_k1'", "'token_k9'"]),
    ("rs_threshold_required", "tiny_cpu", ["algorithm.rollout_correction.rollout_rs=token_k2"],
     ["algorithm.rollout_correction.rollout_rs_threshold", "must be given"]),
    ("rs_threshold_without_rs", "tiny_cpu", ["algorithm.rollout_correction.rollout_rs_threshold=2.0"],
     ["algorithm.rollout_correction.rollout_rs_threshold: only used when"]),
    ("rs_threshold_bounds", "tiny_cpu", ["algorithm.rollout_correction.rollout_rs=seq_max_k2",
                                         "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
     ["algorithm.rollout_correction.rollout_rs_threshold", "single upper bound"]),
    ("rs_threshold_count", "tiny_cpu", ["algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k2,seq_mean_k3",
                                        "algorithm.rollout_correction.rollout_rs_threshold=2.0,0.1"],
     ["algorithm.rollout_correction.rollout_rs_threshold", "give 1 or 3"]),
    # reward
    ("format_score_above_score", "tiny_cpu", ["reward.format_score=2.0"], ["reward.format_score: must be in [0, reward.score (1.0)]"]),
    ("length_penalty_negative", "tiny_cpu", ["reward.length_penalty_coef=-1"], ["reward.length_penalty_coef: must be >= 0"]),
    ("length_penalty_buffer_beyond_response", "tiny_cpu", ["reward.length_penalty_coef=1", "reward.length_penalty_buffer=9"],
     ["reward.length_penalty_buffer: must be in [1, data.max_response_length (8)] or null, got 9"]),
    ("length_penalty_buffer_zero", "tiny_cpu", ["reward.length_penalty_coef=1", "reward.length_penalty_buffer=0"],
     ["reward.length_penalty_buffer: must be in [1, data.max_response_length (8)]"]),
    ("length_penalty_buffer_without_coef", "tiny_cpu", ["reward.length_penalty_buffer=4"],
     ["reward.length_penalty_buffer: is set (4) but reward.length_penalty_coef is 0"]),
    ("repetition_penalty_negative", "tiny_cpu", ["reward.repetition_penalty_coef=-1"],
     ["reward.repetition_penalty_coef: must be >= 0"]),
    ("repetition_ngram_positive", "tiny_cpu", ["reward.repetition_ngram_size=0"], ["reward.repetition_ngram_size: must be > 0"]),
    ("custom_reward_name_empty", "tiny_cpu", ["reward.custom_reward_function.name=''"],
     ["reward.custom_reward_function.name: must be a function name"]),
    ("custom_reward_name_without_path", "tiny_cpu", ["reward.custom_reward_function.name=my_reward"],
     ["reward.custom_reward_function.name: only used with reward.custom_reward_function.path (it is null)",
      "'my_reward'"]),
    # trainer
    ("total_epochs_positive", "tiny_cpu", ["trainer.total_epochs=0"], ["trainer.total_epochs: must be > 0"]),
    ("total_training_steps_positive", "tiny_cpu", ["trainer.total_training_steps=0"],
     ["trainer.total_training_steps: must be > 0"]),
    ("critic_warmup_negative", "tiny_cpu", ["trainer.critic_warmup=-1"], ["trainer.critic_warmup: must be >= 0"]),
    ("save_freq", "tiny_cpu", ["trainer.save_freq=0"], ["trainer.save_freq: must be -1 (only at the end) or >= 1"]),
    ("test_freq", "tiny_cpu", ["trainer.test_freq=-2"], ["trainer.test_freq: must be -1 (off) or >= 1"]),
    ("test_freq_without_val_files", "tiny_cpu", ["data.val_files=[]"],
     ["trainer.test_freq: validates every 10 steps but data.val_files is empty"]),
    ("max_consecutive_skips", "tiny_cpu", ["trainer.max_consecutive_skips=0"],
     ["trainer.max_consecutive_skips: must be -1 (never stop) or >= 1, got 0"]),
    ("log_val_generations_negative", "tiny_cpu", ["trainer.log_val_generations=-1"],
     ["trainer.log_val_generations: must be >= 0"]),
    ("logger_duplicates", "tiny_cpu", ["trainer.logger=[console, jsonl, console]"], ["trainer.logger: lists ['console']"]),
    ("log_dir_placeholder", "tiny_cpu", ["trainer.log_dir=logs/{run}"], ["trainer.log_dir: only {project_name} and"]),
    ("ckpt_dir_placeholder", "tiny_cpu", ["trainer.default_local_dir=ckpt/{0}"], ["trainer.default_local_dir: only"]),
    ("resume_path_needs_a_path", "tiny_cpu", ["trainer.resume_mode=resume_path"],
     ["trainer.resume_from_path: required with resume_mode=resume_path"]),
    ("resume_path_ignored", "tiny_cpu", ["trainer.resume_from_path=ckpt/step_4"],
     ["trainer.resume_from_path: only used with trainer.resume_mode=resume_path (it is auto)"]),
    ("ckpt_to_keep_positive", "tiny_cpu", ["trainer.max_actor_ckpt_to_keep=0"], ["trainer.max_actor_ckpt_to_keep: must be > 0"]),
    ("critic_ckpt_to_keep_positive", "tiny_cpu", ["trainer.max_critic_ckpt_to_keep=0"],
     ["trainer.max_critic_ckpt_to_keep: must be > 0"]),
    # cluster
    ("nnodes_positive", "tiny_cpu", ["cluster.nnodes=0"], ["cluster.nnodes: must be > 0"]),
    ("gpus_positive", "tiny_cpu", ["cluster.n_gpus_per_node=0"], ["cluster.n_gpus_per_node: must be > 0"]),
    ("tp_positive", "gsm8k_ppo", ["cluster.ref.tensor_model_parallel_size=0"],
     ["cluster.ref.tensor_model_parallel_size: must be > 0"]),
    ("pp_positive", "gsm8k_ppo", ["cluster.critic.pipeline_model_parallel_size=0"],
     ["cluster.critic.pipeline_model_parallel_size: must be > 0"]),
    ("world_divisible_by_tp_pp", "gsm8k_ppo", ["cluster.actor.tensor_model_parallel_size=3"],
     ["cluster.actor: tensor_model_parallel_size x pipeline_model_parallel_size = 3 must divide the world size",
      "= 8"]),
    ("sequence_parallel_needs_tp", "gsm8k_ppo", ["cluster.actor.sequence_parallel=true"],
     ["cluster.actor.sequence_parallel: needs tensor_model_parallel_size > 1"]),
]


@pytest.mark.parametrize("base, overrides, expected", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_validation_error_names_the_key(base, overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(base, overrides)
    message = str(info.value)
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"


def test_nccl_timeout_may_be_below_the_backstop_on_cpu():
    """cluster.device=cpu never runs NCCL: a long gloo backstop alone is no error."""
    cfg = load_config("tiny_cpu", ["cluster.collective_timeout_s=3600"])
    assert (cfg.cluster.collective_timeout_s, cfg.cluster.nccl_timeout_s) == (3600, 1800)


def test_rule_ids_are_unique():
    ids = [r[0] for r in RULES]
    assert len(ids) == len(set(ids))


def test_unknown_key_in_a_yaml_file_names_the_file_and_suggests(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text((CONFIG_DIR / "tiny_cpu.yaml").read_text().replace("  ppo_epochs: 2\n  clip_ratio:",
                                                                       "  ppo_epoch: 1\n  clip_ratio:"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "actor.ppo_epoch: unknown key; did you mean 'actor.ppo_epochs'?" in str(info.value)


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", ["actor.clip_ratio_c=0.5", "algorithm.gamma=2", "trainer.save_freq=0"])
    assert len(info.value.errors) == 3 and "3 problems" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_config_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="no config named 'nope'; shipped configs: .*tiny_cpu"):
        load_config("nope")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file 'x/y.yaml' does not exist"):
        load_config("x/y.yaml")


def test_malformed_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("actor: [\n")
    with pytest.raises(ConfigError, match="broken.yaml.*cannot parse YAML"):
        load_config(path)


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- actor\n")
    with pytest.raises(ConfigError, match="<root>: expected a mapping"):
        load_config(path)


def test_val_before_train_without_val_files_is_a_warning_naming_both_keys(caplog):
    with caplog.at_level("WARNING", logger="megatron_ppo.config.checks"):
        load_config("tiny_cpu", ["data.val_files=[]", "trainer.test_freq=-1", "trainer.val_before_train=true"])
    assert "trainer.val_before_train=true does nothing: data.val_files is empty" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megatron_ppo.config.checks"):
        for name in ("tiny_cpu", "gsm8k_ppo"):
            load_config(name)
        load_config("tiny_cpu", ["data.val_files=[]", "trainer.test_freq=-1", "trainer.val_before_train=false"])
    assert "val_before_train" not in caplog.text


def test_custom_reward_name_with_its_path_is_accepted(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def my_reward(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    cfg = load_config("tiny_cpu", [f"reward.custom_reward_function.path={path}",
                                   "reward.custom_reward_function.name=my_reward"])
    assert cfg.reward.custom_reward_function.name == "my_reward"
