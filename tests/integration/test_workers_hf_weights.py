"""A trainable role built from HF weights keeps them through its optimizer's steps in bf16: Megatron's bf16 optimizer
keeps fp32 main copies of the parameters, taken when it is built (before the HF weights are loaded), and writes them
back into the model at every step. Without a reload after the load, the first step turned the loaded model back into
its random initialisation (bf16 is the GPU default, `<role>.model.dtype=auto`)."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.config import load_config
from megatron_ppo.testing.tiny_hf import TINY_VOCAB, make_tiny_hf


@pytest.mark.parametrize("role,distributed", [("actor", False), ("critic", False), ("actor", True)])
def test_bf16_role_from_hf_weights_keeps_them_through_a_step(role, distributed, tmp_path, megatron_single):
    """distributed: Megatron's DistributedOptimizer (its own main-param shards, the same hazard)."""
    from megatron_ppo.workers.actor import ActorWorker
    from megatron_ppo.workers.critic import CriticWorker

    hf_dir = make_tiny_hf("llama", str(tmp_path / "hf"), seed=4)
    cfg = load_config("tiny_cpu", [f"actor.model.path={hf_dir}", "actor.model.arch=null",
                                   f"{role}.model.dtype=bfloat16", f"{role}.optim.lr=0.0", f"{role}.optim.weight_decay=0.0",
                                   f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                                   f"cluster.{role}.use_distributed_optimizer={str(distributed).lower()}"])
    worker = (ActorWorker if role == "actor" else CriticWorker)(cfg, TINY_VOCAB)
    assert next(worker.model.parameters()).dtype == torch.bfloat16
    loaded = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
    worker.optimizer.zero_grad()
    worker.optimizer.step()  # lr 0: an update of nothing, but the main params are written back into the model
    changed = [k for k, v in worker.model.named_parameters() if not torch.equal(v.detach(), loaded[k])]
    backbone = [k for k in loaded if not k.startswith("output_layer.")]
    assert backbone and not changed, f"{role}: a step changed {len(changed)} of {len(loaded)} tensors: {changed[:3]}"


@pytest.mark.parametrize("init", ["normal", "zeros"])
def test_critic_value_head_init(init, tmp_path, megatron_single):
    """critic.value_head_init: a fresh head on a pretrained backbone gives values of std ~0.02 x |hidden| (normal), or
    0 everywhere (zeros); the backbone is the HF model's either way, and a zeroed head still learns (its gradient is
    the hidden state times the value error, not 0)."""
    from megatron_ppo.workers.critic import CriticWorker

    hf_dir = make_tiny_hf("llama", str(tmp_path / "hf"), seed=4)
    cfg = load_config("tiny_cpu", [f"actor.model.path={hf_dir}", "actor.model.arch=null",
                                   f"critic.value_head_init={init}", f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    worker = CriticWorker(cfg, TINY_VOCAB)
    head = worker.model.output_layer.weight
    assert bool((head == 0).all()) == (init == "zeros")
    hidden = torch.randn(5, 2, head.shape[1])
    values, _ = worker.model.output_layer(hidden)
    assert bool((values == 0).all()) == (init == "zeros")
    (values.float() - 1.0).pow(2).mean().backward()  # a value error: the head's gradient is not 0
    assert head.grad is not None or getattr(head, "main_grad", None) is not None
    grad = head.grad if head.grad is not None else head.main_grad
    assert float(grad.abs().sum()) > 0
