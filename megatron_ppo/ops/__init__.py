"""The one front door to the kernels: CUDA extension -> CPU extension -> torch reference, per tensor device.

    ops.gae(token_level_rewards, values, response_mask, gamma, lam) -> (advantages, returns)   # un-whitened
    ops.token_logprobs_entropy(logits, target_ids, *, vocab_start_index=0, tp_group=None) -> (log_probs, entropy)
    TP pieces: ops.partial_stats, ops.rebase_stats, ops.finish_stats, ops.logprobs_entropy_backward
    ops.backend(device) -> "cuda" | "cpu" | "reference"

``MEGATRON_PPO_OPS=reference`` (or ``ops.set_mode("reference")``) forces the torch reference; ``=kernels``
makes a missing extension an error. See docs/kernels.md.
"""
from megatron_ppo.ops._backend import backend, mode, set_mode, unavailable_reason
from megatron_ppo.ops.gae import gae
from megatron_ppo.ops.logprob_entropy import (
    finish_stats,
    logprobs_entropy_backward,
    partial_stats,
    rebase_stats,
    token_logprobs_entropy,
)

__all__ = [
    "backend",
    "finish_stats",
    "gae",
    "logprobs_entropy_backward",
    "mode",
    "partial_stats",
    "rebase_stats",
    "set_mode",
    "token_logprobs_entropy",
    "unavailable_reason",
]
