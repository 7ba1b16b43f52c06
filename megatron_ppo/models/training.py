"""Megatron DDP + optimizer around a model stage.

Thin on purpose: megatron's DistributedDataParallel (grad buffers, DP reduce, optional distributed optimizer) and
``get_megatron_optimizer`` do the work; this module only wires the config hooks the pipeline schedules call
(``no_sync_func``, ``finalize_model_grads_func`` — which also all-reduces sequence-parallel norm grads over TP and
tied-embedding grads over PP — and ``grad_scale_func``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass


def ddp_overlap(backend: str, use_distributed_optimizer: bool) -> dict:
    """DDP's communication overlap for a process-group backend: on NCCL Megatron-LM's training settings — gradients
    reduced per bucket while the backward runs (megatron's bucket size: max(40M, 1M x DP) parameters) and, with
    the distributed optimizer, parameters all-gathered per bucket as the next forward reaches them; on gloo one
    synchronous bucket after the backward (what the CPU tests and runs were validated with)."""
    overlap = backend == "nccl"
    return {"overlap_grad_reduce": overlap, "overlap_param_gather": overlap and use_distributed_optimizer}


def wrap_ddp(model, *, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             overlap_param_gather: bool = False, grad_reduce_in_fp32: bool = True, bucket_size: int | None = None):
    """Wrap a GPTModel stage in megatron DDP and set the schedule hooks on its config. With
    ``overlap_param_gather`` the parameters are current only once a forward has run after a step (its pre-hooks
    wait for each bucket's all-gather): read them otherwise through ``sync_params`` first."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    if overlap_param_gather and not (use_distributed_optimizer and overlap_grad_reduce):
        raise ValueError("overlap_param_gather needs the distributed optimizer and overlap_grad_reduce")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def sync_params(ddp_models) -> None:
    """All-gather every parameter bucket now (synchronously): after a step with ``overlap_param_gather`` the
    weights are stale until a forward's pre-hooks gather them, so anything reading them outside a forward — a
    checkpoint, a weight export, a decode step that calls the linears itself — calls this first."""
    for chunk in (list(ddp_models) if isinstance(ddp_models, (list, tuple)) else [ddp_models]):
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


@dataclass
class OptimizerSettings:
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False


def build_optimizer(ddp_models, settings: OptimizerSettings | None = None):
    """megatron Adam over the DDP-wrapped stage(s); sets ``config.grad_scale_func``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    s = settings or OptimizerSettings()
    chunks = list(ddp_models) if isinstance(ddp_models, (list, tuple)) else [ddp_models]
    cfg = chunks[0].config
    opt_config = OptimizerConfig(
        optimizer="adam", lr=s.lr, weight_decay=s.weight_decay, adam_beta1=s.adam_beta1, adam_beta2=s.adam_beta2,
        adam_eps=s.adam_eps, clip_grad=s.clip_grad, use_distributed_optimizer=s.use_distributed_optimizer,
        bf16=cfg.bf16, fp16=cfg.fp16, params_dtype=cfg.params_dtype,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    cfg.grad_scale_func = _weak_method(optimizer.scale_loss)
    return optimizer


def _weak_method(method):
    """``method`` called through a weak reference to its object. The model config must not keep the optimizer
    alive: the distributed optimizer's fp32 shards are views of the parameters, whose autograd nodes carry DDP's
    gradient hooks, so config -> optimizer closed a reference cycle through C++ that Python's collector cannot
    break, and every model built in a process stayed alive with its process groups (gloo keeps threads per
    group). The optimizer's owner (the worker) keeps it alive while it is used."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            raise RuntimeError("the optimizer of this model's grad_scale_func was freed: keep build_optimizer's "
                               "result for as long as the model trains")
        return bound(*args, **kwargs)

    return call
