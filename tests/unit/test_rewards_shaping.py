"""Shaping terms (length, n-gram repetition) and the batch entry point with its reward/* metrics."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_ppo.rewards import (
    LengthPenalty, RepetitionPenalty, RewardError, RewardScorer, compute_rewards, ngram_repeat_ratio, register_reward,
)


def test_length_penalty_piecewise():
    p = LengthPenalty(max_length=100, buffer=20, coef=0.5)
    assert [p(n) for n in (0, 80, 90, 100, 150)] == [0.0, 0.0, -0.25, -0.5, -0.5]
    linear = LengthPenalty(max_length=100, buffer=100, coef=2.0)  # buffer == max_length: -coef * n / max_length
    assert linear(25) == -0.5 and linear(100) == -2.0
    with pytest.raises(ValueError, match="buffer"):
        LengthPenalty(max_length=10, buffer=20)
    with pytest.raises(ValueError, match="coef=-1"):
        LengthPenalty(max_length=10, buffer=5, coef=-1)


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 4))
def test_repeat_ratio_matches_counting_reference(tokens, n):
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    repeats = sum(1 for i, g in enumerate(grams) if g in grams[:i])  # n-grams seen before
    expected = repeats / len(grams) if grams else 0.0
    assert math.isclose(ngram_repeat_ratio(tokens, n), expected)


def test_repetition_penalty():
    looped = [1, 2, 3] * 10
    assert RepetitionPenalty(coef=1.0, ngram=3)(list(range(30))) == 0.0
    ratio = ngram_repeat_ratio(looped, 3)
    assert ratio == pytest.approx(1 - 3 / 28)
    assert RepetitionPenalty(coef=2.0, ngram=3)(looped) == pytest.approx(-2.0 * ratio)
    assert RepetitionPenalty(coef=1.0, ngram=3, threshold=0.5)(looped) == pytest.approx(-(ratio - 0.5) / 0.5)
    with pytest.raises(ValueError, match="threshold=1.0"):
        RepetitionPenalty(threshold=1.0)


def test_compute_rewards_terms_and_metrics():
    out = compute_rewards(
        ["ok\n#### 7", "#### 8", "the the the the the the #### 7"], ["openai/gsm8k"] * 3, ["7", "7", "7"],
        response_ids=[[1, 2, 3], list(range(90)), [5, 5, 5, 5, 5, 5, 5, 5]],
        reward_kwargs={"openai/gsm8k": {"format_score": 0.1}},
        length_penalty=LengthPenalty(max_length=100, buffer=20), repetition_penalty=RepetitionPenalty(ngram=2))
    assert out.terms["task"].tolist() == [1.0, 0.1, 1.0]
    assert out.terms["length_penalty"].tolist() == [0.0, -0.5, 0.0]
    assert out.terms["repetition_penalty"].tolist() == pytest.approx([0.0, 0.0, -6 / 7])
    np.testing.assert_allclose(out.scores, out.terms["task"] + out.terms["length_penalty"]
                               + out.terms["repetition_penalty"])
    assert out.metrics["reward/task/mean"] == pytest.approx(0.7)
    assert out.metrics["reward/score/min"] == pytest.approx(-0.4)
    assert set(out.metrics) == {f"reward/{t}/{s}" for t in ("task", "length_penalty", "repetition_penalty", "score")
                                for s in ("mean", "min", "max")} | {"reward/score/num_large"}


def test_per_row_errors_name_the_row(reward_registry):
    @register_reward("test/nan-reward")
    def nan_reward(solution_str, ground_truth, extra_info=None):
        return float("nan") if solution_str == "bad" else 1.0

    with pytest.raises(RewardError, match=r"row 1 \(test/nan-reward\): reward function returned nan"):
        compute_rewards(["good", "bad"], ["test/nan-reward"] * 2, ["x", "x"])
    with pytest.raises(RewardError, match=r"row 0 \(openai/gsm8k\): reward_model.ground_truth is missing"):
        compute_rewards(["#### 1"], ["openai/gsm8k"], [None])
    with pytest.raises(ValueError, match="ground_truths has 1 entries for 2 responses"):
        compute_rewards(["a", "b"], ["openai/gsm8k"] * 2, ["1"])
    with pytest.raises(ValueError, match="length_penalty needs response_lengths or response_ids"):
        compute_rewards(["#### 1"], ["openai/gsm8k"], ["1"], length_penalty=LengthPenalty(10, 5))
    with pytest.raises(RewardError, match="returned a dict without 'score'"):
        compute_rewards(["a"], ["x"], ["1"], reward_fn=lambda source, s, g, extra: {"acc": 1.0})


def test_scorer_from_the_project_config(tmp_path):
    from megatron_ppo.config import RewardConfig

    cfg = RewardConfig()
    cfg.method, cfg.format_score, cfg.length_penalty_coef, cfg.repetition_penalty_coef = "numeric", 0.1, 0.5, 1.0
    scorer = RewardScorer.from_config(cfg, max_response_length=200)
    out = scorer(["#### 1,234", "#### 5"], ["openai/gsm8k"] * 2, ["1234", "6"], response_ids=[[1] * 100, [2, 3]])
    assert out.terms["task"].tolist() == [1.0, 0.1]
    assert out.terms["length_penalty"].tolist() == [-0.25, -0.005]  # linear: -coef * length / max_response_length
    assert out.terms["repetition_penalty"][0] == pytest.approx(-(1 - 1 / 98))  # 98 trigrams, 1 distinct
    custom = tmp_path / "r.py"
    custom.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 3.0 if data_source == 'mine' else 0.0\n")
    cfg = SimpleNamespace(method="strict", score=1.0, format_score=0.0, format_requires_marker=False,
                          length_penalty_coef=0.0, repetition_penalty_coef=0.0, repetition_ngram_size=3,
                          custom_reward_function=SimpleNamespace(path=str(custom), name="compute_score"))
    assert RewardScorer.from_config(cfg, 10)(["x"], ["mine"], ["y"]).scores.tolist() == [3.0]


def test_overlong_buffer_matches_verl_dapo_reward_manager():
    """reward.length_penalty_buffer + length_penalty_coef = verl's DAPO overlong_buffer (len, penalty_factor): the
    same reward at every response length, scored by verl's own DAPORewardManager."""
    import torch
    from verl import DataProto
    from verl.workers.reward_manager.dapo import DAPORewardManager

    from megatron_ppo.config import RewardConfig

    max_len, buffer, factor = 16, 6, 0.7
    lengths = list(range(1, max_len + 1))

    class DigitTokenizer:  # the text is irrelevant here: the task reward is a constant, only lengths matter
        eos_token = "</s>"

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(str(int(i)) for i in ids)

    prompt_len = 3
    mask = torch.zeros(len(lengths), prompt_len + max_len, dtype=torch.long)
    mask[:, :prompt_len] = 1
    for row, n in enumerate(lengths):
        mask[row, prompt_len:prompt_len + n] = 1
    data = DataProto.from_dict(
        tensors={"prompts": torch.ones(len(lengths), prompt_len, dtype=torch.long),
                 "responses": torch.ones(len(lengths), max_len, dtype=torch.long), "attention_mask": mask},
        non_tensors={"data_source": np.array(["x"] * len(lengths), dtype=object),
                     "reward_model": np.array([{"ground_truth": "1"}] * len(lengths), dtype=object)})
    manager = DAPORewardManager(DigitTokenizer(), 0, compute_score=lambda **kw: 0.25, max_resp_len=max_len,
                                overlong_buffer_cfg=SimpleNamespace(enable=True, len=buffer, penalty_factor=factor,
                                                                    log=False))
    verl_rewards = manager(data).sum(-1).tolist()

    cfg = RewardConfig()
    cfg.length_penalty_coef, cfg.length_penalty_buffer = factor, buffer
    ours = RewardScorer.from_config(cfg, max_response_length=max_len)(
        ["x"] * len(lengths), ["openai/gsm8k"] * len(lengths), ["1"] * len(lengths),
        response_lengths=lengths).terms["length_penalty"] + 0.25
    assert ours.tolist() == pytest.approx(verl_rewards, abs=1e-6)
    assert ours[max_len - buffer - 1] == 0.25 and ours[-1] == pytest.approx(0.25 - factor)  # the ramp's two ends
