"""The rollout seam: what any engine is asked (``SamplingParams``), what it answers (``GenerationOutput``) and the
``RolloutEngine`` protocol, plus the one rule for a replica's sampling seed.

``SamplingParams`` is algorithm-level only (what to sample); how an engine runs its loop is the engine's own
config section (rollout.megatron.* for the in-actor Megatron engine, rollout/megatron.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

RUN_SEED_MULTIPLIER = 100003  # the rollout stream is seeded apart from the model-init stream (trainer.seed)


@dataclass(frozen=True)
class SamplingParams:
    max_response_length: int
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.max_response_length < 1:
            raise ValueError(f"SamplingParams.max_response_length must be >= 1, got {self.max_response_length}")
        if self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature} (use greedy=True)")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    responses: torch.Tensor  # [B, R] long, pad_token_id after the end
    response_lengths: torch.Tensor  # [B] long, eos included
    log_probs: torch.Tensor  # [B, R] float32, 0 after the end
    finished: torch.Tensor  # [B] bool: ended with an eos token (else: hit max_response_length)

    def response_mask(self) -> torch.Tensor:
        r = self.responses.shape[1]
        return torch.arange(r).unsqueeze(0) < self.response_lengths.unsqueeze(1)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses with the actor's current policy. ``sync_weights`` runs after every actor update: an
    engine holding its own copy of the weights (vLLM) loads them there; the in-actor engine shares the actor's
    model and has nothing to do."""

    def generate(self, prompt_ids: Sequence[torch.Tensor], params: SamplingParams) -> GenerationOutput: ...

    def sync_weights(self) -> None: ...


def replica_seed(run_seed: int, step: int, dp_size: int, dp_rank: int) -> int:
    """The sampling seed of DP replica ``dp_rank`` at ``step``: different per replica and step, reproducible from
    trainer.seed alone (derived here only; the driver sends no seed)."""
    from megatron_ppo.distributed.layout import DP_SEED_STRIDE, dp_seed

    return dp_seed(run_seed * RUN_SEED_MULTIPLIER + DP_SEED_STRIDE * dp_size * step, dp_rank)
