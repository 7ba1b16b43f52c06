"""forward_backward over megatron's pipeline schedules, for micro-batches of any (dynamic) size and any loss.

    results = forward_backward(model, micro_batches, loss_fn)            # training step (grads accumulate)
    outputs = forward_backward(model, micro_batches, loss_fn, forward_only=True)

``loss_fn(output, batch) -> (loss, metrics)`` runs on the last pipeline stage: ``output`` is the model output of
the micro-batch (logits [B, S, V/TP] or values [B, S, 1]), ``loss`` a scalar tensor, ``metrics`` a dict.
``loss`` is this micro-batch's contribution to the step's loss: the gradients are those of
``sum over micro-batches of loss`` (megatron's division by the number of micro-batches is undone), averaged over
data-parallel replicas by DDP. A token-mean over the whole mini-batch is therefore
``loss = token_sum / mini_batch_tokens`` per micro-batch.
Returns the list of per-micro-batch ``metrics`` on the last stage, [] on the others.
"""
from __future__ import annotations

from functools import partial

import torch

from megatron_ppo.models.forward import model_forward
from megatron_ppo.models.unwrap import unwrap_model
from megatron_ppo.profiling import phase_range


def _as_list(model):
    return list(model) if isinstance(model, (list, tuple)) else [model]


def forward_backward(model, micro_batches: list[dict], loss_fn, *, forward_only: bool = False) -> list[dict]:
    """Run all micro-batches through megatron's schedule for this PP layout (1F1B when PP > 1)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward: no micro-batches")
    chunks = _as_list(model)
    n = len(micro_batches)

    def _loss(batch, output):
        loss, metrics = loss_fn(output, batch)
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar tensor as loss, got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))}")
        return loss * n, metrics  # megatron divides by the number of micro-batches

    role = getattr(unwrap_model(chunks[0]), "role", "model")

    def _step(data_iterator, stage_model):
        batch = next(data_iterator)
        with phase_range(f"{role}/forward"):
            out = model_forward(stage_model, batch)
        return out, partial(_loss, batch)

    config = unwrap_model(chunks[0]).config
    seq_len = max(int(b["input_ids"].shape[1]) for b in micro_batches)
    mbs = max(int(b["input_ids"].shape[0]) for b in micro_batches)
    if not config.variable_seq_lengths and len({tuple(b["input_ids"].shape) for b in micro_batches}) > 1:
        raise ValueError("forward_backward: micro-batches of different shapes need config.variable_seq_lengths")
    fb = get_forward_backward_func()
    with phase_range(f"{role}/{'forward_only' if forward_only else 'forward_backward'}"):
        return fb(forward_step_func=_step, data_iterator=iter(micro_batches), model=chunks, num_microbatches=n,
                  seq_length=seq_len, micro_batch_size=mbs, forward_only=forward_only)
