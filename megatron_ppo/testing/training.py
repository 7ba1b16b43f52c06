"""One optimizer step over a list of micro-batches, for the model tests (the product's step, with its skip and
non-finite handling, is ``workers.megatron_worker.MegatronWorker.train_step``).
"""
from __future__ import annotations

from megatron_ppo.models.schedule import forward_backward


def train_step(ddp_models, optimizer, micro_batches: list[dict], loss_fn):
    """Zero grads, forward+backward all micro-batches (grads accumulate), optimizer step.

    Returns (metrics per micro-batch [last stage], update_successful, grad_norm)."""
    chunks = list(ddp_models) if isinstance(ddp_models, (list, tuple)) else [ddp_models]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = forward_backward(chunks, micro_batches, loss_fn)
    update_successful, grad_norm, _ = optimizer.step()
    return metrics, update_successful, grad_norm
