"""Messages name config keys, files and rows, not internals (issue 15)."""
from __future__ import annotations

import pytest

from megatron_ppo.data.sampler import StatefulSampler
from megatron_ppo.rewards.batch import RewardError, RewardScorer, compute_rewards
from megatron_ppo.rewards.registry import load_custom_reward_fn


def test_sampler_batch_larger_than_rows_names_the_keys():
    with pytest.raises(ValueError) as info:
        StatefulSampler(4, 8)
    assert "data.train_batch_size=8" in str(info.value) and "data.train_files" in str(info.value)
    assert "drop_last" not in str(info.value)


def test_raising_custom_reward_names_file_row_and_data_source(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return 1 / (len(solution_str) - 3)\n")
    fn = load_custom_reward_fn(path, "compute_score")
    with pytest.raises(RewardError) as info:
        compute_rewards(["a", "abc"], ["src/a", "src/b"], ["1", "2"], reward_fn=fn)
    text = str(info.value)
    assert "row 1" in text and "'src/b'" in text and str(path) in text and "ZeroDivisionError" in text, text
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_raising_registered_reward_names_the_function(tmp_path):
    from megatron_ppo.rewards.registry import _REGISTRY, register_reward

    def broken(solution_str, ground_truth, extra_info=None, **kwargs):
        raise KeyError("answer")

    register_reward("test/broken")(broken)
    try:
        with pytest.raises(RewardError, match=r"row 0 \(data_source 'test/broken'\): reward function .*broken .*"
                                              r"test_cli_messages.py:\d+\) raised KeyError"):
            RewardScorer()(["x"], ["test/broken"], ["1"])
    finally:
        _REGISTRY.pop("test/broken", None)


def test_step_line_is_short_with_progress_and_eta():
    from megatron_ppo import console

    console._step_clock.clear()
    metrics = {f"actor/m{i}": float(i) for i in range(40)}
    metrics.update({"reward/score/mean": 0.25, "actor/ppo_kl": 0.0012, "timing/step": 2.0})
    first = console.step_line(1, metrics, total_steps=4)
    assert first.startswith("step 1/4") and "reward 0.25" in first and "kl 0.0012" in first
    assert "2.00 s/step" in first and "ETA 0:00:06" in first and "actor/m3" not in first
    assert len(first) < 120
    assert "ETA" not in console.step_line(4, metrics, total_steps=4)


def test_quiet_filters_megatron_developer_warnings():
    import warnings

    from megatron_ppo import console

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet(verbose=False)
        warnings.warn_explicit("full scope is deprecated", UserWarning, "transformer_config.py", 1705,
                               module="megatron.core.transformer.transformer_config")
        warnings.warn_explicit("all_gather_into_tensor is deprecated", FutureWarning, "c10d_logger.py", 83,
                               module="torch.distributed.c10d_logger")
        warnings.warn_explicit("a user's own warning", UserWarning, "mine.py", 1, module="my_reward")
    assert [str(w.message) for w in caught] == ["a user's own warning"]


def test_overlong_prompt_error_names_config_keys(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_ppo.data.prompt_dataset import PromptDataset, PromptTooLongError
    from megatron_ppo.data.schema import GSM8K_PROMPT_SCHEMA
    from megatron_ppo.data.tokenizer import gsm8k_tokenizer

    tok = gsm8k_tokenizer(tmp_path / "tok")
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 1 + 2 + 3 + 4?"}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "10"}, "extra_info": None}
    pq.write_table(pa.Table.from_pylist([row], schema=GSM8K_PROMPT_SCHEMA), tmp_path / "p.parquet")
    with pytest.raises(PromptTooLongError) as info:
        PromptDataset(tmp_path / "p.parquet", tok, max_prompt_length=4)
    text = str(info.value)
    assert "data.max_prompt_length" in text and "data.filter_overlong_prompts" in text and "data.truncation" in text
    assert "overlong_prompt_policy" not in text


def test_top_level_help_names_every_subcommand(capsys):
    """`megatron-ppo --help` lists each command's subcommands (it once omitted `convert gguf-to-hf`), read from the
    commands' own parsers, so a new subcommand without a mention fails here."""
    import argparse

    from megatron_ppo.cli import main
    from megatron_ppo.convert.cli import build_parser
    from megatron_ppo.data.preprocess import _parser

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
    for command, parser in (("convert", build_parser()), ("preprocess", _parser())):
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        for sub in subs:
            assert sub in lines[command], (command, sub, lines[command])
    assert "checkpoint verify" in lines["checkpoint"]
