"""Large-but-finite rewards pass the reward check (they are finite) but are warned about once per batch, with the
observed range, and counted: a reward of 1e30 squares to inf in the value loss."""
from __future__ import annotations

from megatron_ppo.rewards.batch import LARGE_REWARD, compute_rewards


def _score(values):
    table = dict(zip("abc", values))
    return lambda source, text, truth, extra: table[text]


def test_large_rewards_are_warned_about_once_with_the_range_and_counted(caplog):
    with caplog.at_level("WARNING", logger="megatron_ppo.rewards.batch"):
        out = compute_rewards(list("abc"), ["s"] * 3, ["t"] * 3, reward_fn=_score([1e30, 0.5, -2e5]))
    assert out.metrics["reward/score/num_large"] == 2
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "2 of 3 rewards exceed |10000|" in warnings[0].getMessage()
    assert "observed range [-200000, 1e+30]" in warnings[0].getMessage()


def test_ordinary_rewards_are_not_warned_about(caplog):
    with caplog.at_level("WARNING", logger="megatron_ppo.rewards.batch"):
        out = compute_rewards(list("abc"), ["s"] * 3, ["t"] * 3, reward_fn=_score([LARGE_REWARD, -1.0, 0.0]))
    assert out.metrics["reward/score/num_large"] == 0 and not caplog.records
