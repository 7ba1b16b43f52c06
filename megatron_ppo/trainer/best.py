"""trainer.save_best: which validation is the best so far. Pure: the driver feeds it each validation's metrics and
saves (and protects from pruning) the step it names; trainer/checkpoint.py marks that step on disk."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ppo.errors import UsageError

DEFAULT_PREFIX = "val/test_score/"


def validation_score(metrics: dict, key: str | None) -> float | None:
    """The number save_best maximises in one step's metrics: ``key`` (trainer.best_metric), else the mean of every
    ``val/test_score/<source>``; None when the step did not validate. A named key that a validation did not log is
    refused, listing what it logged (a typo must not silently keep the first step forever)."""
    validated = sorted(k for k in metrics if k.startswith("val/"))
    if not validated:
        return None
    if key is not None:
        if key not in metrics:
            raise UsageError(f"trainer.best_metric={key!r}: the validation logged no such metric; it logged "
                             f"{', '.join(validated)}")
        return float(metrics[key])
    scores = [float(metrics[k]) for k in validated if k.startswith(DEFAULT_PREFIX)]
    return sum(scores) / len(scores) if scores else None


@dataclass
class BestValidation:
    """The best validated step so far and its score (None before the first validation during training)."""
    step: int | None = None
    score: float | None = None

    def improved_by(self, score: float | None) -> bool:
        """A finite score above every earlier one (ties keep the earlier step; NaN is never best)."""
        return score is not None and math.isfinite(score) and (self.score is None or score > self.score)

    def state_dict(self) -> dict:
        return {"step": self.step, "score": self.score}

    @classmethod
    def from_state(cls, state: dict | None) -> "BestValidation":
        """(absent from checkpoints saved before save_best: nothing validated counts as best yet)"""
        state = state or {}
        return cls(state.get("step"), state.get("score"))
