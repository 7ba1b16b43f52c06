"""Score a batch: rule reward per data_source + shaping terms -> total scores and reward/* metrics."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from megatron_ppo.errors import UsageError
from megatron_ppo.rewards.registry import get_reward_fn
from megatron_ppo.rewards.shaping import LengthPenalty, RepetitionPenalty

log = logging.getLogger(__name__)

# |score| above this is finite but suspicious: PPO's value loss squares it (1e30 -> inf in fp32) and a score above
# ~3.4e38 does not even fit the fp32 reward tensor. Such batches are warned about (with the observed range) and
# counted as reward/score/num_large; the trainer then skips any update they make non-finite.
LARGE_REWARD = 1e4


class RewardError(UsageError):
    """A reward could not be computed for a row (missing ground truth, non-finite result, bad return type)."""


@dataclass
class RewardOutput:
    scores: np.ndarray  # float64 [B]: the sum of all terms, the sequence-level reward PPO uses
    terms: dict[str, np.ndarray]  # "task" (the data_source's reward) and each configured shaping term, [B] each
    metrics: dict[str, float]  # reward/<term>/{mean,min,max}, reward/score/{mean,min,max,num_large}


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


def describe_fn(fn) -> str:
    """'path/to/file.py:name' of a reward function (what a user looks for when it raises)."""
    import inspect

    try:
        where = inspect.getsourcefile(fn) or "?"
        line = inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return getattr(fn, "__qualname__", repr(fn))
    return f"{getattr(fn, '__qualname__', fn)} ({where}:{line})"


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
    reward_fn: Callable | None = None,
) -> RewardOutput:
    """Per-row scores for decoded responses.

    reward_kwargs: per data_source keyword arguments for its reward function,
        e.g. {"openai/gsm8k": {"mode": "numeric", "format_score": 0.1}}.
    response_ids / response_lengths: token ids (repetition is measured on them; else on whitespace-split words)
        and lengths (default: len(response_ids[i])) for the length penalty.
    reward_fn: a verl-style custom function fn(data_source, solution_str, ground_truth, extra_info) used for every
        row instead of the registry (verl's custom_reward_function).
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
        extra = extra_infos[i] if extra_infos is not None else None
        fn = reward_fn if reward_fn is not None else get_reward_fn(source)
        try:
            if reward_fn is not None:
                value = reward_fn(source, text, truth, extra)
            else:
                value = fn(text, truth, extra_info=extra, **reward_kwargs.get(source, {}))
        except Exception as exc:  # the user's function failed: say which function, on which row and data_source
            raise RewardError(f"row {i} (data_source {source!r}): reward function {describe_fn(fn)} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        task[i] = _as_score(value, i, source)
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
    large = int(np.sum(np.abs(scores) > LARGE_REWARD)) if n else 0
    metrics["reward/score/num_large"] = float(large)
    if large:
        log.warning("%d of %d rewards exceed |%g| (observed range [%g, %g]): finite, but large enough to overflow "
                    "the value loss in fp32; check the reward function's scale", large, n, LARGE_REWARD,
                    float(scores.min()), float(scores.max()))
    return RewardOutput(scores=scores, terms=terms, metrics=metrics)


@dataclass
class RewardScorer:
    """compute_rewards with its settings bound, built once from the config and called per step by the driver."""

    reward_kwargs: Mapping[str, Mapping] | None = None
    length_penalty: LengthPenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    reward_fn: Callable | None = None

    @classmethod
    def from_config(cls, reward_cfg, max_response_length: int) -> "RewardScorer":
        """From the `reward` config section: method/score/format_score/format_requires_marker (GSM8K),
        length_penalty_coef and length_penalty_buffer (DAPO's overlong ramp; no buffer: linear -coef * length /
        max_response_length), repetition_penalty_coef and repetition_ngram_size, and
        custom_reward_function.{path,name}."""
        from megatron_ppo.rewards.registry import load_custom_reward_fn

        gsm8k = {"mode": reward_cfg.method, "score": reward_cfg.score, "format_score": reward_cfg.format_score,
                 "format_requires_marker": reward_cfg.format_requires_marker}
        custom = reward_cfg.custom_reward_function
        return cls(
            reward_kwargs={"openai/gsm8k": gsm8k},
            # no buffer: buffer == max_length turns the soft overlong ramp into the linear -coef * length / max_length
            length_penalty=LengthPenalty(max_response_length, reward_cfg.length_penalty_buffer or max_response_length,
                                         reward_cfg.length_penalty_coef)
            if reward_cfg.length_penalty_coef > 0 else None,
            repetition_penalty=RepetitionPenalty(reward_cfg.repetition_penalty_coef, reward_cfg.repetition_ngram_size)
            if reward_cfg.repetition_penalty_coef > 0 else None,
            reward_fn=load_custom_reward_fn(custom.path, custom.name) if custom.path else None,
        )

    def __call__(self, responses, data_sources, ground_truths, **per_batch) -> RewardOutput:
        """per_batch: extra_infos, response_ids, response_lengths (see compute_rewards)."""
        return compute_rewards(responses, data_sources, ground_truths, reward_kwargs=self.reward_kwargs,
                               length_penalty=self.length_penalty, repetition_penalty=self.repetition_penalty,
                               reward_fn=self.reward_fn, **per_batch)


@dataclass
class ScoredResponses:
    """What the driver's scoring of a rollout batch gives: the sequence rewards and their metrics, and (rule or
    custom rewards) the decoded responses and the task term, which `megatron-ppo eval` reads accuracy from."""

    values: list[float]  # the sequence reward of each row
    metrics: dict[str, float]
    texts: list[str] | None = None  # None when a reward model scored the token ids
    task: np.ndarray | None = None  # the data_source's own reward (no shaping), rule / custom rewards only


def score_responses(batch, tokenizer, scorer: RewardScorer, reward_group=None, balance: bool = True) -> ScoredResponses:
    """A rollout batch's responses scored the way training and validation score them (one function, so that
    `megatron-ppo eval` and `train`'s validation give the same numbers): the reward model's group when there is
    one (it replaces the rule, as in verl), else the rule / custom function on the decoded text + shaping."""
    lengths = batch.response_lengths
    if reward_group is not None:
        scores = reward_group.call_rows("compute_scores", batch.select(keys=(), meta=False), batch.row_tokens(),
                                        balance=balance)["scores"]
        metrics = {"reward/score/mean": float(scores.mean()), "reward/score/min": float(scores.min()),
                   "reward/score/max": float(scores.max()), "reward/rm_score/mean": float(scores.mean()),
                   "reward/rm_score/std": float(scores.std()) if batch.size > 1 else 0.0}
        return ScoredResponses([float(v) for v in scores], metrics)
    ids = [batch.responses[i, : int(lengths[i])].tolist() for i in range(batch.size)]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    truths = [rm.get("ground_truth") if rm else None for rm in batch.meta["reward_model"]]
    out = scorer(texts, batch.meta["data_source"], truths, extra_infos=batch.meta["extra_info"],
                 response_ids=ids, response_lengths=lengths.tolist())
    return ScoredResponses([float(v) for v in out.scores], out.metrics, texts, out.terms["task"])
