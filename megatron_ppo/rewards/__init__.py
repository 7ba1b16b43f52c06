"""Rule rewards and shaping terms.

    from megatron_ppo.rewards import compute_rewards, register_reward, LengthPenalty, RepetitionPenalty

`registry` maps a row's data_source to its reward function (GSM8K built in; add yours with @register_reward),
`gsm8k` holds the GSM8K rule (strict = verl's rule, numeric = compares numbers), `shaping` the length and
repetition penalties, and `batch.compute_rewards` scores a batch and returns per-term metrics for logging.
"""
from megatron_ppo.rewards.batch import RewardError, RewardOutput, RewardScorer, compute_rewards
from megatron_ppo.rewards.registry import (
    UnknownDataSourceError, get_reward_fn, load_custom_reward_fn, register_reward, registered_data_sources,
)
from megatron_ppo.rewards.shaping import LengthPenalty, RepetitionPenalty, ngram_repeat_ratio

__all__ = [
    "LengthPenalty", "RepetitionPenalty", "RewardError", "RewardOutput", "RewardScorer", "UnknownDataSourceError",
    "compute_rewards", "get_reward_fn", "load_custom_reward_fn", "ngram_repeat_ratio", "register_reward",
    "registered_data_sources",
]
