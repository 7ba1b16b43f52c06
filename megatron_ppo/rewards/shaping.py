"""Reward shaping terms against reward hacking: over-long responses and repetitive ones. Both are <= 0."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LengthPenalty:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer, then a linear ramp to -coef at max_length,
    and -coef beyond it."""

    max_length: int
    buffer: int
    coef: float = 1.0

    def __post_init__(self):
        if not 0 < self.buffer <= self.max_length:
            raise ValueError(f"length_penalty: need 0 < buffer ({self.buffer}) <= max_length ({self.max_length})")
        if self.coef < 0:
            raise ValueError(f"length_penalty: coef={self.coef} must be >= 0")

    def __call__(self, length: int) -> float:
        start = self.max_length - self.buffer
        if length <= start:
            return 0.0
        return -self.coef * min(1.0, (length - start) / self.buffer)


def ngram_repeat_ratio(tokens: Sequence, n: int) -> float:
    """Fraction of a sequence's n-grams that repeat an earlier one: 1 - distinct / total (0 when too short)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    distinct = len({tuple(tokens[i:i + n]) for i in range(total)})
    return 1.0 - distinct / total


@dataclass(frozen=True)
class RepetitionPenalty:
    """-coef * (ratio - threshold) / (1 - threshold) when the n-gram repeat ratio exceeds `threshold`, else 0."""

    coef: float = 1.0
    ngram: int = 4
    threshold: float = 0.0

    def __post_init__(self):
        if self.ngram < 1:
            raise ValueError(f"repetition_penalty: ngram={self.ngram} must be >= 1")
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"repetition_penalty: threshold={self.threshold} must be in [0, 1)")
        if self.coef < 0:
            raise ValueError(f"repetition_penalty: coef={self.coef} must be >= 0")

    def __call__(self, tokens: Sequence) -> float:
        excess = ngram_repeat_ratio(tokens, self.ngram) - self.threshold
        return -self.coef * excess / (1.0 - self.threshold) if excess > 0 else 0.0
