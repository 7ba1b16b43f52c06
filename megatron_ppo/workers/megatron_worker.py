"""A thin worker: one Megatron model shard plus (for trainable roles) DDP, optimizer and lr schedule.

It answers forward / train_step and decides nothing about the algorithm: the role workers
(workers/actor.py, critic.py, ref.py) build on it, hand it packed micro-batches and the loss or output function
to run on them, and run the PPO loops themselves.
"""
from __future__ import annotations

import math

import torch

from megatron_ppo import parallel
from megatron_ppo.algo import checks
from megatron_ppo.models.gpt import build_gpt_model
from megatron_ppo.models.schedule import forward_backward
from megatron_ppo.profiling import phase_range
from megatron_ppo.models.training import OptimizerSettings, build_optimizer, sync_params, wrap_ddp
from megatron_ppo.models.training import ddp_overlap as ddp_overlap_settings
from megatron_ppo.ops.cpu_matmul import onednn_matmul
from megatron_ppo.parallel.transfer import to_device, to_host


# cpu_gemm="auto": oneDNN from this hidden size up: below it (the tests' tiny hidden-64 model) the routing costs more
# than it gains; at SmolLM2-135M's 576 it gains, much on an AMD EPYC, little on an Intel Xeon. Measured by
# tools/bench_cpu_matmul.py: docs/models.md ("fp32 CPU GEMMs on oneDNN"), docs/bench/models.md, docs/bench/peer.md.
ONEDNN_MIN_HIDDEN = 512


class MegatronWorker:
    def __init__(self, role: str, arch, *, optim=None, total_steps: int = 1, params_dtype=torch.float32,
                 use_distributed_optimizer: bool = False, recompute: dict | None = None,
                 sequence_parallel: bool = False, cpu_gemm: str = "auto", ddp_overlap: bool | None = None):
        """recompute: activation checkpointing as models.gpt.build_gpt_model takes it ({"granularity", "method",
        "num_layers"}); use_distributed_optimizer: Megatron's DistributedOptimizer (state sharded over DP);
        cpu_gemm: "onednn" runs the fp32 CPU GEMMs of forward and train_step on oneDNN (ops/cpu_matmul.py),
        "torch" leaves them to torch (MKL), "auto" is onednn from hidden size ONEDNN_MIN_HIDDEN up;
        ddp_overlap: DDP's communication overlap (models/training.ddp_overlap); None: by the backend (NCCL on)."""
        if cpu_gemm not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_gemm must be 'auto', 'onednn' or 'torch', got {cpu_gemm!r}")
        self.role = role
        self.cpu_gemm = cpu_gemm
        self.model = build_gpt_model(arch, role=role, params_dtype=params_dtype, recompute=recompute,
                                     sequence_parallel=sequence_parallel)
        # the dispatch mode costs a Python call per aten op: only where its GEMMs can gain (CPU, not a toy model)
        self.device = next(self.model.parameters()).device  # micro-batches come from the driver on the CPU
        self.onednn = self.device.type == "cpu" and (
            cpu_gemm == "onednn" or (cpu_gemm == "auto" and arch.hidden_size >= ONEDNN_MIN_HIDDEN))
        self.ddp = self.optimizer = self.scheduler = None
        self.params_stale = False  # a step ran and overlap_param_gather has not gathered its result yet
        if optim is not None:
            backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
            overlap = ddp_overlap_settings(backend if ddp_overlap is None else ("nccl" if ddp_overlap else "gloo"),
                                           use_distributed_optimizer)
            self.ddp = wrap_ddp(self.model, use_distributed_optimizer=use_distributed_optimizer, **overlap)
            self.optimizer = build_optimizer(self.ddp, OptimizerSettings(
                lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
                clip_grad=optim.clip_grad, use_distributed_optimizer=use_distributed_optimizer))
            self.scheduler = _lr_scheduler(self.optimizer, optim, total_steps)

    @property
    def module(self):
        return self.ddp if self.ddp is not None else self.model

    @torch.no_grad()
    def forward(self, micro_batches: list[dict], output_fn) -> list[dict]:
        """output_fn(model_output, micro_batch) -> dict of tensors, per micro-batch (no gradients)."""
        self.module.eval()
        micro_batches = [to_device(mb, self.device) for mb in micro_batches]
        with onednn_matmul(self.onednn), checks.deferred():
            outputs = forward_backward(self.module, micro_batches,
                                       lambda out, mb: (out.new_zeros(()), output_fn(out, mb)), forward_only=True)
        self.params_stale = False  # the forward's pre-hooks gathered every bucket
        return to_host(outputs)

    def current_params(self) -> None:
        """Make the model's parameters the optimizer's latest before reading them outside a forward (generation,
        weight export, checkpoints): with overlap_param_gather a step leaves them to the next forward's hooks."""
        if self.params_stale:
            sync_params(self.ddp)
            self.params_stale = False

    def train_step(self, micro_batches: list[dict], loss_fn, skip_step=None) -> dict:
        """One optimizer step over the micro-batches.

        Returns {"micro": [per micro-batch metrics as floats], "loss", "grad_norm", "lr", "update_skipped",
        "skip_reason"}; how the micro-batch metrics combine is the caller's business (workers/role.py's update loop,
        ``reduce_metrics``). The update is skipped (gradients dropped; weights and optimizer state unchanged) when
          - the summed loss or the global gradient norm is not finite on any rank ("nonfinite"): a step with an
            inf/nan loss or norm must never reach the weights, whatever the precision (Megatron's own check only
            exists in fp16, via the loss scaler);
          - fp16's loss scaler found an overflow ("loss_scale_overflow", Megatron's own skip; the scale shrinks);
          - skip_step(micro_metrics) says so ("kl_guard"), the caller's decision (the actor's target-KL guard).
        The lr schedule advances per training step: see step_lr_scheduler."""
        if self.optimizer is None:
            raise RuntimeError(f"{self.role} worker has no optimizer (built frozen)")
        self.module.train()
        micro_batches = [to_device(mb, self.device) for mb in micro_batches]
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = []

        def recording_loss_fn(output, micro):
            loss, metrics = loss_fn(output, micro)
            losses.append(loss.detach().float())
            return loss, metrics

        with onednn_matmul(self.onednn), checks.deferred():  # the value checks' verdicts: one read, at the end
            raw = forward_backward(self.ddp, micro_batches, recording_loss_fn)
        self.params_stale = False
        # every micro-batch's metrics and the loss in one host read (losses live on the last pipeline stage)
        per_micro, totals = read_metrics(raw, [torch.stack(losses).sum()] if losses else [])
        loss = totals[0] if losses else 0.0
        result = {"micro": per_micro, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"]}
        if skip_step is not None and skip_step(per_micro):
            return self._skip(result, float("nan"), "kl_guard")
        # optimizer.step() = prepare_grads -> get_grad_norm/clip -> step_with_ready_grads (megatron/core/optimizer/
        # optimizer.py, 0.16.1); we run the three parts ourselves to check the norm before anything is applied.
        with phase_range(f"{self.role}/optimizer_step"):
            if self.optimizer.prepare_grads():  # fp16 loss-scale overflow (always False in fp32/bf16)
                return self._skip(result, float("nan"), "loss_scale_overflow")
            grad_norm = float(self.optimizer.get_grad_norm())  # global: reduced over the optimizer's grad-stats group
            if parallel.any_rank(not (math.isfinite(loss) and math.isfinite(grad_norm))):
                return self._skip(result, grad_norm, "nonfinite")
            _clip_grads(self.optimizer, grad_norm)
            ok = self.optimizer.step_with_ready_grads()
        self.params_stale = self.ddp.ddp_config.overlap_param_gather
        return {**result, "grad_norm": grad_norm, "update_skipped": float(not ok), "skip_reason": None if ok else
                "optimizer"}

    def _skip(self, result: dict, grad_norm: float, reason: str) -> dict:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return {**result, "grad_norm": grad_norm, "update_skipped": 1.0, "skip_reason": reason}

    def step_lr_scheduler(self) -> float:
        """Advance the lr schedule by one training step (verl's rule: once per step, however many optimizer
        steps the step's mini-batches and epochs took); returns the lr the step used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        return lr


def read_metrics(per_micro: list[dict], extra: list) -> tuple[list[dict], list[float]]:
    """Per-micro-batch metric dicts (tensors or numbers) as floats, and ``extra`` values as floats, with one host
    read for all the tensors (a ``float()`` per metric per micro-batch is a stream drain each on a GPU)."""
    tensors = [v for m in per_micro for v in m.values() if isinstance(v, torch.Tensor)]
    tensors += [v for v in extra if isinstance(v, torch.Tensor)]
    values = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist() if tensors else [])
    floats = [{key: next(values) if isinstance(v, torch.Tensor) else float(v) for key, v in m.items()}
              for m in per_micro]
    return floats, [next(values) if isinstance(v, torch.Tensor) else float(v) for v in extra]


def _lr_scheduler(optimizer, optim, total_steps: int):
    """Megatron's OptimizerParamScheduler from the verl-style optim config (warmup, then constant/linear/cosine)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total_steps)
    decay_steps = max(optim.lr_decay_steps or total_steps, warmup + 1)
    min_lr = optim.min_lr if optim.lr_decay_style != "constant" else optim.lr
    for group in optimizer.param_groups:  # get_megatron_optimizer leaves min_lr=None in each group, and the
        group["max_lr"], group["min_lr"] = optim.lr, min_lr  # scheduler prefers a group's values to its own
    return _RestorableScheduler(
        optimizer, init_lr=optim.lr_warmup_init, max_lr=optim.lr, min_lr=min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay_steps, lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")


def _restorable_scheduler_class():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class RestorableScheduler(OptimizerParamScheduler):
        """Megatron's scheduler whose load_state_dict restores the SAVED schedule exactly.

        Megatron's own load (0.16.1) takes max_lr/min_lr from the state but computes the lr from each param
        group's max_lr/min_lr (which _lr_scheduler writes from the current config), and adds the saved num_steps
        to its own count instead of setting it: a schedule restored into a scheduler built from another config
        (or one that already stepped) ran the wrong curve."""

        def load_state_dict(self, state_dict: dict) -> None:
            for group in self.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = float(state_dict["max_lr"]), float(state_dict["min_lr"])
            self.num_steps = 0
            super().load_state_dict(state_dict)
            self.step(increment=0)  # weight decay too, from the restored wd settings

    return RestorableScheduler


def _RestorableScheduler(*args, **kwargs):  # noqa: N802 - a class, built lazily (megatron imports are heavy)
    return _restorable_scheduler_class()(*args, **kwargs)


def _clip_grads(optimizer, grad_norm: float) -> None:
    """Clip by the global norm already computed, as MegatronOptimizer.step / ChainedOptimizer.step do."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0.0:
            continue
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
