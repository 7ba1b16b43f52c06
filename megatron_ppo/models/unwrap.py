"""The GPTModel inside whatever wraps it (megatron DDP, Float16Module: each holds the next as ``.module``)."""
from __future__ import annotations


def unwrap_model(model):
    """The innermost module: follow ``.module`` until there is none (a bare model is returned as it is)."""
    while hasattr(model, "module"):
        model = model.module
    return model
