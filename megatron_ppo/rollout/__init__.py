"""Rollout: engines behind one protocol (``RolloutEngine``: generate, sync_weights) and the sources of a step's
rollouts (online | offline, rollout/source.py).

``rollout.name`` chooses the engine; its settings are ``rollout.<name>.*``: ``megatron``, the actor's own model with
a KV cache (rollout/megatron.py), or ``vllm``, a vLLM process per actor DP replica (rollout/vllm.py). An engine is
built in the actor's ranks (workers/actor.py).
"""
from __future__ import annotations

from megatron_ppo.rollout.base import GenerationOutput, RolloutEngine, SamplingParams, replica_seed

ENGINES = {"megatron": "megatron_ppo.rollout.megatron", "vllm": "megatron_ppo.rollout.vllm"}  # rollout.name -> module with build_engine(worker, cfg)

__all__ = ["ENGINES", "GenerationOutput", "RolloutEngine", "SamplingParams", "build_engine", "replica_seed"]


def build_engine(name: str, worker, cfg) -> RolloutEngine:
    """The engine ``rollout.name`` names, for the actor worker ``worker`` (one per rank)."""
    import importlib

    if name not in ENGINES:
        raise ValueError(f"rollout.name={name!r}: no such rollout engine; choose one of {sorted(ENGINES)}")
    return importlib.import_module(ENGINES[name]).build_engine(worker, cfg)
