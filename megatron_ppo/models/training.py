"""Megatron DDP + optimizer around a model stage.

Thin on purpose: megatron's DistributedDataParallel (grad buffers, DP reduce, optional distributed optimizer) and
``get_megatron_optimizer`` do the work; this module only wires the config hooks the pipeline schedules call
(``no_sync_func``, ``finalize_model_grads_func`` — which also all-reduces sequence-parallel norm grads over TP and
tied-embedding grads over PP — and ``grad_scale_func``).
"""
from __future__ import annotations

from dataclasses import dataclass


def wrap_ddp(model, *, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             grad_reduce_in_fp32: bool = True, bucket_size: int | None = None):
    """Wrap a GPTModel stage in megatron DDP and set the schedule hooks on its config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


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
    cfg.grad_scale_func = optimizer.scale_loss
    return optimizer
