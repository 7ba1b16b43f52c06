"""Counting a model's forwards in tests, whichever path runs them (``GPTModel.forward`` or the lean decode step)."""
from __future__ import annotations

from megatron_ppo.models.unwrap import unwrap_model


def record_forward_shapes(model):
    """(shapes, handle): the [B, s] token-id shape of every forward of this first-stage model, recorded by a real
    forward pre-hook on its embedding, which both ``GPTModel.forward`` and ``rollout.decode_step`` call (the static
    step at TP1; at TP > 1 it computes the vocab-parallel lookup itself, unrecorded)."""
    shapes = []

    def hook(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        shapes.append(tuple(ids.shape))

    handle = unwrap_model(model).embedding.register_forward_pre_hook(hook, with_kwargs=True)
    return shapes, handle
