"""GSM8K rule reward: strict mode == verl's compute_score (all 1,319 test answers and perturbations);
numeric mode compares numbers; the data_source registry."""
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")

from megatron_ppo.data.gsm8k import default_gsm8k_dir, final_answer  # noqa: E402
from megatron_ppo.rewards import (  # noqa: E402
    UnknownDataSourceError, get_reward_fn, load_custom_reward_fn, register_reward, registered_data_sources,
)
from megatron_ppo.rewards.gsm8k import compute_score, extract_answer, parse_number  # noqa: E402


@pytest.fixture(scope="module")
def verl_score():
    from verl.utils.reward_score.gsm8k import compute_score as verl_compute_score

    return verl_compute_score


@pytest.fixture(scope="module")
def test_answers():
    records = [json.loads(line) for line in open(default_gsm8k_dir() / "test.jsonl", encoding="utf-8")]
    assert len(records) == 1319
    return [(r["answer"], final_answer(r["answer"])) for r in records]


def _perturbations(answer, truth):
    body = answer.rsplit("####", 1)[0]
    n = int(truth)
    return [
        answer,  # the reference solution
        body,  # no final line
        body + f"#### {n + 1}",  # wrong number
        body + f"#### {n:,}",  # thousands separator
        body + f"#### {n}.0",  # decimal form
        body + f"#### ${n}",  # dollar sign (strict's regex needs a digit right after "#### ")
        body + f"####{n}",  # no space
        answer + "\n" + "padding " * 60,  # answer pushed out of verl's 300-character window
        f"The answer is {n}.",  # no marker at all
        body + f"#### -{n}",
    ]


def test_strict_agrees_with_verl_on_all_test_answers(verl_score, test_answers):
    truths = [t for _, t in test_answers]
    for i, (answer, truth) in enumerate(test_answers):
        assert compute_score(answer, truth) == verl_score(answer, truth) == 1.0, i
        other = truths[(i + 1) % len(truths)]
        assert compute_score(answer, other) == verl_score(answer, other), i
        for text in _perturbations(answer, truth):
            for fs in (0.0, 0.1):
                ours, theirs = compute_score(text, truth, format_score=fs), verl_score(text, truth, format_score=fs)
                assert ours == theirs, (i, text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("#### $,.-0123456789abc\n")), max_size=400),
       st.sampled_from(["18", "1234", "-3", "0", "1.5"]))
def test_strict_agrees_with_verl_on_random_text(verl_score, text, truth):
    assert compute_score(text, truth, format_score=0.1) == verl_score(text, truth, format_score=0.1)


@pytest.mark.parametrize("text,truth,strict,numeric", [
    ("so the total is\n#### 1,234", "1234", 1.0, 1.0),
    ("#### 18.0", "18", 0.0, 1.0),
    ("#### 18.50", "18.5", 0.0, 1.0),
    ("#### $1,234.00", "1234", 0.0, 1.0),
    ("#### -3", "3", 0.0, 0.0),
    ("it costs 5 and then 42.", "42", 0.0, 1.0),  # numeric falls back to the last number
    ("#### 7\nnote: 9 more", "7", 1.0, 1.0),  # numeric prefers the marked answer over a later number
    ("no numbers here", "7", 0.0, 0.0),
])
def test_numeric_mode(verl_score, text, truth, strict, numeric):
    assert compute_score(text, truth, mode="strict") == strict == verl_score(text, truth)
    assert compute_score(text, truth, mode="numeric") == numeric


def test_verl_flexible_gets_formatted_numbers_wrong(verl_score):
    # the motivation for numeric mode: verl compares strings, so equal numbers are marked wrong
    assert verl_score("The total is 1,234", "1234", method="flexible") == 0
    assert verl_score("The total is 18.0", "18", method="flexible") == 0
    assert verl_score("The total is 42.", "42", method="flexible") == 0  # the sentence's full stop is kept
    assert compute_score("The total is 42.", "42", mode="numeric") == 1.0
    assert compute_score("The total is 1,234", "1234", mode="numeric") == 1.0
    assert compute_score("The total is 18.0", "18", mode="numeric") == 1.0


def test_format_score_and_helpers():
    assert compute_score("#### 5", "6", format_score=0.1) == 0.1  # found but wrong
    assert compute_score("nothing", "6", format_score=0.1) == 0.0  # nothing found
    assert compute_score("#### 6", "6", score=2.0) == 2.0
    assert extract_answer("a 1 b 2,000 c", mode="numeric") == "2,000"
    assert parse_number("1,234.50") == parse_number("1234.5") and parse_number("abc") is None
    with pytest.raises(ValueError, match="mode='loose'"):
        compute_score("#### 1", "1", mode="loose")


def test_registry_lookup_errors_and_custom_sources(tmp_path, reward_registry):
    assert get_reward_fn("openai/gsm8k") is compute_score
    with pytest.raises(UnknownDataSourceError, match=r"'my/unknown'; registered: \[.*'openai/gsm8k'.*\]"):
        get_reward_fn("my/unknown")

    @register_reward("test/exact", "test/exact-alias")
    def exact(solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    assert get_reward_fn("test/exact-alias") is exact and "test/exact" in registered_data_sources()
    with pytest.raises(ValueError, match="'test/exact' already has reward"):
        register_reward("test/exact")(lambda s, g, extra_info=None: 0.0)
    with pytest.raises(ValueError, match="at least one data_source"):
        register_reward()

    module = tmp_path / "my_reward.py"
    module.write_text("from megatron_ppo.rewards import register_reward\n"
                      "@register_reward('test/from-file')\n"
                      "def by_length(solution_str, ground_truth, extra_info=None):\n    return len(solution_str)\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 0.5}\n")
    fn = load_custom_reward_fn(module)
    assert fn("x", "y", "z") == {"score": 0.5} and get_reward_fn("test/from-file")("abc", "") == 3
    with pytest.raises(AttributeError, match=r"no function 'missing'; it defines \[.*'by_length'"):
        load_custom_reward_fn(module, "missing")
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        load_custom_reward_fn(tmp_path / "nope.py")


def test_format_requires_marker_rewards_the_marker_and_keeps_right_prose_answers():
    """numeric + format_requires_marker: right in any form 1, wrong but marked "#### N" format_score, wrong prose 0.
    The strict rule scores right prose 0, below a wrong "#### N": the reason the option exists."""
    kw = {"mode": "numeric", "format_score": 0.1, "format_requires_marker": True}
    assert compute_score("so the answer is 18.", "18", **kw) == 1.0
    assert compute_score("steps...\n#### 18", "18", **kw) == 1.0
    assert compute_score("steps...\n#### $17", "18", **kw) == 0.1
    assert compute_score("so the answer is 17.", "18", **kw) == 0.0
    assert compute_score("no number at all", "18", **kw) == 0.0
    assert compute_score("so the answer is 17.", "18", mode="numeric", format_score=0.1) == 0.1  # the default
    assert compute_score("so the answer is 18.", "18", mode="strict", format_score=0.1) == 0.0


def test_scorer_passes_format_requires_marker_from_the_config():
    from megatron_ppo.config import RewardConfig
    from megatron_ppo.rewards import RewardScorer

    cfg = RewardConfig()
    cfg.method, cfg.format_score, cfg.format_requires_marker = "numeric", 0.1, True
    out = RewardScorer.from_config(cfg, max_response_length=64)(
        ["the answer is 18", "the answer is 17", "#### 17"], ["openai/gsm8k"] * 3, ["18"] * 3)
    assert out.scores.tolist() == [1.0, 0.0, 0.1]
