"""A thin worker: one Megatron model shard plus (for trainable roles) DDP, optimizer and lr schedule.

It answers generate / forward / train_step / state_dict and decides nothing about the algorithm: the driver hands
it packed micro-batches and the loss or output function to run on them. The Ray driver will wrap this class in an
actor per rank unchanged.
"""
from __future__ import annotations

import torch

from megatron_ppo.models.generation import GenerationOutput, SamplingParams, generate
from megatron_ppo.models.gpt import build_gpt_model
from megatron_ppo.models.schedule import forward_backward
from megatron_ppo.models.training import OptimizerSettings, build_optimizer, copy_weights, wrap_ddp


class MegatronWorker:
    def __init__(self, role: str, arch, *, optim=None, total_steps: int = 1, params_dtype=torch.float32,
                 use_distributed_optimizer: bool = False):
        self.role = role
        self.model = build_gpt_model(arch, role=role, params_dtype=params_dtype)
        self.ddp = self.optimizer = self.scheduler = None
        if optim is not None:
            self.ddp = wrap_ddp(self.model, use_distributed_optimizer=use_distributed_optimizer)
            self.optimizer = build_optimizer(self.ddp, OptimizerSettings(
                lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
                clip_grad=optim.clip_grad, use_distributed_optimizer=use_distributed_optimizer))
            self.scheduler = _lr_scheduler(self.optimizer, optim, total_steps)

    @property
    def module(self):
        return self.ddp if self.ddp is not None else self.model

    def generate(self, prompt_ids: list[torch.Tensor], params: SamplingParams) -> GenerationOutput:
        return generate(self.module, prompt_ids, params)

    @torch.no_grad()
    def forward(self, micro_batches: list[dict], output_fn) -> list[dict]:
        """output_fn(model_output, micro_batch) -> dict of tensors, per micro-batch (no gradients)."""
        self.module.eval()
        return forward_backward(self.module, micro_batches, lambda out, mb: (out.new_zeros(()), output_fn(out, mb)),
                                forward_only=True)

    def train_step(self, micro_batches: list[dict], loss_fn, skip_step=None) -> dict:
        """One optimizer step over the micro-batches.

        Returns {"micro": [per micro-batch metrics as floats], "grad_norm", "lr", "update_skipped"}; how the
        micro-batch metrics combine is the driver's business. skip_step(micro_metrics) -> bool, decided by the
        driver after forward/backward (e.g. the target-KL guard): on skip the gradients are dropped and weights,
        optimizer state stay unchanged. The lr schedule advances per training step: see step_lr_scheduler."""
        if self.optimizer is None:
            raise RuntimeError(f"{self.role} worker has no optimizer (built frozen)")
        self.module.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        per_micro = [{key: float(value) for key, value in m.items()}
                     for m in forward_backward(self.ddp, micro_batches, loss_fn)]
        result = {"micro": per_micro, "lr": self.optimizer.param_groups[0]["lr"]}
        if skip_step is not None and skip_step(per_micro):
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            return {**result, "grad_norm": float("nan"), "update_skipped": 1.0}
        ok, grad_norm, _ = self.optimizer.step()
        return {**result, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "update_skipped": float(not ok)}

    def step_lr_scheduler(self) -> float:
        """Advance the lr schedule by one training step (verl's rule: once per step, however many optimizer
        steps the step's mini-batches and epochs took); returns the lr the step used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        return lr

    def copy_weights_from(self, other: "MegatronWorker") -> None:
        copy_weights(other.model, self.model)


def _lr_scheduler(optimizer, optim, total_steps: int):
    """Megatron's OptimizerParamScheduler from the verl-style optim config (warmup, then constant/linear/cosine)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total_steps)
    decay_steps = max(optim.lr_decay_steps or total_steps, warmup + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=optim.lr_warmup_init, max_lr=optim.lr,
        min_lr=optim.min_lr if optim.lr_decay_style != "constant" else optim.lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay_steps, lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
