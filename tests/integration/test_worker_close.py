"""A closed MegatronWorker is freed with everything it built (real megatron-core, CPU/gloo, one rank).

megatron keeps a trained model alive through two holds Python's collector cannot break on its own: the optimizer's
shards are views of the parameters, whose autograd nodes carry DDP's gradient hooks, while the model config holds the
optimizer (a cycle through C++); and RoPE's class-wide lru_cache keys its tables by the module. Each leaked model kept
its process groups, whose gloo threads piled up in any process that builds models more than once (the test suite, an
in-process resume).
"""
from __future__ import annotations

import gc
import weakref

import pytest

from test_worker_nonfinite import _loss, _micros, _worker


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distributed_optimizer"])
def test_a_closed_worker_frees_its_model_ddp_optimizer_and_rope(megatron_single, use_distributed_optimizer):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    worker = _worker(use_distributed_optimizer)
    worker.train_step(_micros(), _loss(1.0))  # the backward runs DDP's hooks, the forward fills RoPE's cache
    ropes = [m for m in worker.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes, "the tiny model has no RoPE module: this test would not see RoPE's cache"
    held = {"model": weakref.ref(worker.model), "ddp": weakref.ref(worker.ddp),
            "optimizer": weakref.ref(worker.optimizer), "rope": weakref.ref(ropes[0])}
    del ropes
    worker.close()
    worker.close()  # idempotent
    gc.collect()
    alive = [name for name, ref in held.items() if ref() is not None]
    assert not alive, f"still alive after close: {alive}"
