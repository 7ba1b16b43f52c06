"""Score a batch: rule reward per data_source + shaping terms -> total scores and reward/* metrics."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from megatron_ppo.rewards.registry import get_reward_fn
from megatron_ppo.rewards.shaping import LengthPenalty, RepetitionPenalty


class RewardError(ValueError):
    """A reward could not be computed for a row (missing ground truth, non-finite result, bad return type)."""


@dataclass
class RewardOutput:
    scores: np.ndarray  # float64 [B]: the sum of all terms, the sequence-level reward PPO uses
    terms: dict[str, np.ndarray]  # "task" (the data_source's reward) and each configured shaping term, [B] each
    metrics: dict[str, float]  # reward/<term>/{mean,min,max} and reward/score/{mean,min,max}


def _as_score(value, row: int, data_source: str) -> float:
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardError(f"row {row} ({data_source}): reward function returned a dict without 'score'")
        value = value["score"]
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"row {row} ({data_source}): reward function returned {value!r}, not a number") from None
    if not math.isfinite(value):
        raise RewardError(f"row {row} ({data_source}): reward function returned {value}; rewards must be finite")
    return value


def compute_rewards(
    responses: Sequence[str],
    data_sources: Sequence[str],
    ground_truths: Sequence,
    *,
    extra_infos: Sequence | None = None,
    response_ids: Sequence[Sequence[int]] | None = None,
    response_lengths: Sequence[int] | None = None,
    reward_kwargs: Mapping[str, Mapping] | None = None,
    length_penalty: LengthPenalty | None = None,
    repetition_penalty: RepetitionPenalty | None = None,
) -> RewardOutput:
    """Per-row scores for decoded responses.

    reward_kwargs: per data_source keyword arguments for its reward function,
        e.g. {"openai/gsm8k": {"mode": "numeric", "format_score": 0.1}}.
    response_ids / response_lengths: token ids (repetition is measured on them; else on whitespace-split words)
        and lengths (default: len(response_ids[i])) for the length penalty.
    """
    n = len(responses)
    for name, seq in (("data_sources", data_sources), ("ground_truths", ground_truths), ("extra_infos", extra_infos),
                      ("response_ids", response_ids), ("response_lengths", response_lengths)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"compute_rewards: {name} has {len(seq)} entries for {n} responses")
    reward_kwargs = reward_kwargs or {}
    task = np.zeros(n, dtype=np.float64)
    for i, (text, source, truth) in enumerate(zip(responses, data_sources, ground_truths)):
        if truth is None:
            raise RewardError(f"row {i} ({source}): reward_model.ground_truth is missing")
        fn = get_reward_fn(source)
        extra = extra_infos[i] if extra_infos is not None else None
        task[i] = _as_score(fn(text, truth, extra_info=extra, **reward_kwargs.get(source, {})), i, source)
    terms = {"task": task}
    if length_penalty is not None:
        if response_lengths is None:
            if response_ids is None:
                raise ValueError("compute_rewards: length_penalty needs response_lengths or response_ids")
            response_lengths = [len(ids) for ids in response_ids]
        terms["length_penalty"] = np.array([length_penalty(int(m)) for m in response_lengths], dtype=np.float64)
    if repetition_penalty is not None:
        tokens = response_ids if response_ids is not None else [text.split() for text in responses]
        terms["repetition_penalty"] = np.array([repetition_penalty(list(t)) for t in tokens], dtype=np.float64)
    scores = np.sum(list(terms.values()), axis=0) if n else np.zeros(0)
    metrics = {}
    for name, values in [*terms.items(), ("score", scores)]:
        if n:
            metrics.update({f"reward/{name}/mean": float(values.mean()), f"reward/{name}/min": float(values.min()),
                            f"reward/{name}/max": float(values.max())})
    return RewardOutput(scores=scores, terms=terms, metrics=metrics)
