"""MegatronWorker.train_step never lets a non-finite loss or gradient norm reach the weights (real megatron-core,
CPU/gloo, one rank): the update is skipped, counted with its reason, and weights and Adam state stay bit-identical;
the next finite step trains normally. Both optimizers: Megatron's plain one and its DistributedOptimizer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _worker(use_distributed_optimizer: bool, clip_grad: float = 1.0):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    optim = SimpleNamespace(lr=1e-2, weight_decay=0.01, betas=[0.9, 0.999], clip_grad=clip_grad, lr_warmup_steps=0,
                            lr_warmup_steps_ratio=0.0, lr_warmup_init=0.0, lr_decay_steps=None,
                            lr_decay_style="constant", min_lr=0.0)
    return MegatronWorker("actor", tiny_arch(), optim=optim, use_distributed_optimizer=use_distributed_optimizer)


def _micros():
    from megatron_ppo.models.forward import pack_sequences

    g = torch.Generator().manual_seed(3)
    ids, cu = pack_sequences([torch.randint(0, 512, (n,), generator=g) for n in (7, 5)])
    return [{"input_ids": ids, "cu_seqlens": cu}]


def _loss(scale: float):
    """A real loss on the logits; scale=inf/nan gives a non-finite loss, scale=1e36 a finite loss whose gradient
    norm overflows fp32 (elements ~1e36, their squares ~1e72)."""
    def loss_fn(logits, micro):
        loss = logits.float().mean() * scale
        return loss, {"loss_metric": loss.detach()}
    return loss_fn


def _state(worker):
    params = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    inner = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
    opt = [t.clone() for o in inner for state in o.optimizer.state.values() for t in state.values()
           if torch.is_tensor(t)]  # Adam's exp_avg / exp_avg_sq (and step) of the torch optimizer inside
    return params, opt


def _assert_unchanged(before, worker):
    params, opt = before
    now_params, now_opt = _state(worker)
    assert opt, "no optimizer state to compare"
    assert all(torch.equal(params[k], now_params[k]) for k in params)
    assert len(opt) == len(now_opt) and all(torch.equal(a, b) for a, b in zip(opt, now_opt))


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distributed_optimizer"])
@pytest.mark.parametrize("scale, what", [(float("inf"), "loss"), (float("nan"), "loss"), (1e36, "grad_norm")])
def test_nonfinite_step_is_skipped_and_weights_stay_bit_identical(megatron_single, use_distributed_optimizer,
                                                                  scale, what):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    worker = _worker(use_distributed_optimizer)
    inner = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
    assert any(isinstance(o, DistributedOptimizer) for o in inner) == use_distributed_optimizer
    first = worker.train_step(_micros(), _loss(1.0))  # a finite step first, so Adam has state to protect
    assert first["update_skipped"] == 0 and first["skip_reason"] is None
    before = _state(worker)
    out = worker.train_step(_micros(), _loss(scale))
    assert out["update_skipped"] == 1.0 and out["skip_reason"] == "nonfinite"
    if what == "grad_norm":
        assert torch.isfinite(torch.tensor(out["loss"])) and not torch.isfinite(torch.tensor(out["grad_norm"]))
    else:
        assert not torch.isfinite(torch.tensor(out["loss"]))
    _assert_unchanged(before, worker)
    after = worker.train_step(_micros(), _loss(1.0))  # the skipped step left no gradient behind
    assert after["update_skipped"] == 0 and torch.isfinite(torch.tensor(after["grad_norm"]))
    assert any(not torch.equal(before[0][k], v) for k, v in worker.model.named_parameters())


def test_nonfinite_grad_norm_is_skipped_without_clipping_too(megatron_single):
    """clip_grad=0: Megatron's step would not even compute a norm; the worker still checks it."""
    worker = _worker(False, clip_grad=0.0)
    worker.train_step(_micros(), _loss(1.0))
    before = _state(worker)
    out = worker.train_step(_micros(), _loss(1e36))
    assert out["skip_reason"] == "nonfinite"
    _assert_unchanged(before, worker)


def test_driver_skip_decision_is_reported_as_its_reason(megatron_single):
    worker = _worker(False)
    worker.train_step(_micros(), _loss(1.0))
    before = _state(worker)
    out = worker.train_step(_micros(), _loss(1.0), skip_step=lambda per_micro: True)
    assert out["update_skipped"] == 1.0 and out["skip_reason"] == "kl_guard"
    _assert_unchanged(before, worker)
