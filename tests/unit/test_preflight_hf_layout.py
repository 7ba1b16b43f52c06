"""Preflight (issue 22, item 4): a TP/PP layout that cannot split a role's HF model (its config.json) is refused
before Ray starts, with config.checks' rule for `arch:` models. In process, config.json files only (no weights)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.checks import layout_split_problems, sizes_that_split
from megatron_ppo.trainer.preflight import PreflightError, check_model_paths

# SmolLM2-135M-Instruct's shape (HuggingFaceTB/SmolLM2-135M-Instruct config.json)
SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000, "tie_word_embeddings": True,
        "hidden_act": "silu"}
# tiny_cpu's batches at DP2 (the world is sized TP x PP x 2 below; the critic inherits the actor's model)
BATCHES = ["actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]


def hf_dir(tmp_path: Path, name: str = "smol", **changes) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in {**SMOL, **changes}.items() if v is not None}))
    return d


def config(model: Path, *overrides, tp: int = 2, pp: int = 1):
    layout = [f"cluster.{r}.{k}={v}" for r in ("actor", "ref", "critic")
              for k, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp))]
    return load_config("tiny_cpu", ["actor.model.arch=null", f"actor.model.path={model}", *BATCHES,
                                    f"cluster.n_gpus_per_node={tp * pp * 2}", *layout, *overrides])


def refusal(cfg) -> str:
    with pytest.raises(PreflightError) as info:
        check_model_paths(cfg)
    return str(info.value)


def test_smollm2_at_tp2_is_refused_naming_key_file_numbers_and_fix(tmp_path):
    model = hf_dir(tmp_path)
    message = refusal(config(model, tp=2))
    assert message.startswith("cluster.actor.tensor_model_parallel_size=2 cannot split the actor's model "
                              f"actor.model.path={model}: "), message
    for text in ("num_attention_heads=9", "num_key_value_heads=3", "not divisible by 2", str(model / "config.json"),
                 "set cluster.actor.tensor_model_parallel_size to 1 or 3"):
        assert text in message, (text, message)


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_at_tp_dividing_heads_passes(tmp_path, tp):
    check_model_paths(config(hf_dir(tmp_path), tp=tp))


def test_pp_not_dividing_layers_is_refused(tmp_path):
    model = hf_dir(tmp_path)
    message = refusal(config(model, tp=1, pp=4))
    for text in ("cluster.actor.pipeline_model_parallel_size=4", "num_hidden_layers=30 is not divisible by 4",
                 str(model / "config.json"), "one of 1, 2, 3, 5, 6, 10, 15 or 30"):
        assert text in message, (text, message)
    check_model_paths(config(model, tp=1, pp=2))  # 30 layers split in 2 stages


def test_tp_and_pp_both_wrong_are_named_in_one_error(tmp_path):
    message = refusal(config(hf_dir(tmp_path), tp=2, pp=4))
    assert "tensor_model_parallel_size=2" in message and "pipeline_model_parallel_size=4" in message, message


def test_ref_inheriting_the_actor_path_is_checked_at_its_own_layout(tmp_path):
    model = hf_dir(tmp_path)
    cfg = config(model, "cluster.ref.tensor_model_parallel_size=2", tp=1)
    message = refusal(cfg)
    assert message.startswith(f"cluster.ref.tensor_model_parallel_size=2 cannot split the ref's model "
                              f"actor.model.path={model}"), message


def test_critic_with_its_own_path(tmp_path):
    critic = hf_dir(tmp_path, "critic", num_hidden_layers=7)
    cfg = config(hf_dir(tmp_path), f"critic.model.path={critic}", "cluster.critic.pipeline_model_parallel_size=2",
                 tp=1)
    message = refusal(cfg)
    assert message.startswith(f"cluster.critic.pipeline_model_parallel_size=2 cannot split the critic's model "
                              f"critic.model.path={critic}: num_hidden_layers=7"), message
    assert "to 1 or 7" in message, message


def test_reward_model(tmp_path):
    rm = hf_dir(tmp_path, "rm", architectures=["LlamaForSequenceClassification"], num_labels=1)
    cfg = config(hf_dir(tmp_path), "reward.reward_model.enable=true", f"reward.reward_model.model.path={rm}",
                 "cluster.reward.tensor_model_parallel_size=2", tp=3)
    message = refusal(cfg)
    assert message.startswith(f"cluster.reward.tensor_model_parallel_size=2 cannot split the reward's model "
                              f"reward.reward_model.model.path={rm}"), message


def test_mlp_width_is_split_by_tp_too(tmp_path):
    """megatron-core refuses ffn_hidden_size % TP at build (models/gpt.py): intermediate_size is checked as well."""
    message = refusal(config(hf_dir(tmp_path, num_attention_heads=12, num_key_value_heads=6, intermediate_size=1537),
                             tp=3))
    assert "intermediate_size=1537 is not divisible by 3" in message and "to 1" in message, message


def test_vocab_and_head_dim_are_not_refused(tmp_path):
    """The vocab is padded to make_vocab_size_divisible_by x TP, and hidden_size need not be a multiple of the
    heads (HF's head_dim becomes kv_channels): the runtime takes both, so preflight does too."""
    check_model_paths(config(hf_dir(tmp_path, vocab_size=49153, hidden_size=580), tp=3))


def test_missing_kv_heads_default_to_the_attention_heads(tmp_path):
    message = refusal(config(hf_dir(tmp_path, num_key_value_heads=None), tp=2))
    assert "num_key_value_heads=9" in message, message


def test_missing_counts_are_left_to_the_model_build(tmp_path):
    check_model_paths(config(hf_dir(tmp_path, num_attention_heads=None, num_key_value_heads=None), tp=2))


@pytest.mark.parametrize("heads,groups,layers,tp,pp", [(9, 3, 30, 2, 1), (9, 3, 30, 3, 1), (8, 2, 6, 4, 1),
                                                       (8, 8, 6, 4, 4), (8, 4, 6, 1, 3), (4, 2, 2, 1, 2)])
def test_same_rule_as_inline_arch(tmp_path, heads, groups, layers, tp, pp):
    """An HF directory is refused exactly when the same counts as an `arch:` config are (config.checks._arch)."""
    sizes = [f"cluster.{r}.{k}={v}" for r in ("actor", "ref", "critic")
             for k, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp))]
    arch = dict(num_attention_heads=heads, num_query_groups=groups, num_layers=layers, hidden_size=heads * 16,
                ffn_hidden_size=1536)  # the MLP splits at every TP here (_arch leaves that one to the build)
    arch_error = None
    try:
        load_config("tiny_cpu", [*BATCHES, f"cluster.n_gpus_per_node={tp * pp * 2}", *sizes,
                                 *(f"actor.model.arch.{k}={v}" for k, v in arch.items())])
    except ConfigError as exc:
        arch_error = str(exc)
    model = hf_dir(tmp_path, num_attention_heads=heads, num_key_value_heads=groups, num_hidden_layers=layers,
                   hidden_size=heads * 16, intermediate_size=1536)
    try:
        check_model_paths(config(model, tp=tp, pp=pp))
        hf_error = None
    except PreflightError as exc:
        hf_error = str(exc)
    assert (arch_error is None) == (hf_error is None), (arch_error, hf_error)
    if arch_error is not None:  # refused for the layout, not for something else of the arch
        assert "must be divisible by cluster.actor." in arch_error, arch_error


def test_shared_rule_functions():
    assert layout_split_problems(2, 4, {"heads": 9, "groups": 3, "ffn": 8}, {"layers": 30}) == [
        ("heads", 9, "tensor_model_parallel_size", 2), ("groups", 3, "tensor_model_parallel_size", 2),
        ("layers", 30, "pipeline_model_parallel_size", 4)]
    assert layout_split_problems(3, 2, {"heads": 9, "groups": 3}, {"layers": 30}) == []
    assert layout_split_problems(0, 0, {"heads": 9}, {"layers": 7}) == []  # sizes < 1: another rule's error
    assert sizes_that_split([9, 3, 1536]) == [1, 3]
    assert sizes_that_split([30]) == [1, 2, 3, 5, 6, 10, 15, 30]
