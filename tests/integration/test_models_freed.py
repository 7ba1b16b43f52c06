"""A model its owner drops is freed, with the process groups it holds, by the end of its layout (real megatron-core,
CPU/gloo, one rank; both optimizers).

megatron kept every trained model alive: the model config held the optimizer (``grad_scale_func``), whose
distributed shards are views of the parameters, whose autograd nodes carry DDP's gradient hooks (a cycle through C++
that Python's collector cannot break); and RoPE's class-wide lru_cache keyed its tables by the module. Each leaked
model kept its gloo groups and their threads, which piled up in any process that builds models more than once (a
worker pool running one test's job after another, the test suite, an in-process resume) and kept the CPU busy.
"""
from __future__ import annotations

import weakref

import pytest

from test_worker_nonfinite import _loss, _micros, _worker


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distributed_optimizer"])
def test_a_dropped_worker_is_freed_by_the_end_of_its_layout(megatron_single, use_distributed_optimizer):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_ppo import parallel

    worker = _worker(use_distributed_optimizer)
    worker.train_step(_micros(), _loss(1.0))  # the backward runs DDP's hooks, the forward fills RoPE's cache
    ropes = [m for m in worker.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes, "the tiny model has no RoPE module: this test would not see RoPE's cache"
    held = {"model": weakref.ref(worker.model), "ddp": weakref.ref(worker.ddp),
            "optimizer": weakref.ref(worker.optimizer), "rope": weakref.ref(ropes[0])}
    del worker, ropes
    parallel.destroy(destroy_process_group=False)  # what a job in a worker pool does at its end
    alive = [name for name, ref in held.items() if ref() is not None]
    assert not alive, f"still alive after the layout's end: {alive}"


def test_grad_scale_func_of_a_freed_optimizer_says_so():
    from megatron_ppo.models.training import _weak_method

    class Optimizer:
        def scale_loss(self, loss):
            return loss * 2

    optimizer = Optimizer()
    scale = _weak_method(optimizer.scale_loss)
    assert scale(3) == 6
    del optimizer
    with pytest.raises(RuntimeError, match="keep build_optimizer's result"):
        scale(3)
