"""parallel.destroy(destroy_process_group=False) frees Megatron's process groups: a worker pool that initialises one
layout per job (the launch pool, plan/measure.py) keeps a constant number of threads. Megatron's own
destroy_model_parallel only forgets its ~20 groups; each gloo group keeps polling threads alive, and a full test run
used to reach ~1,800 threads and half the machine's CPU in system time."""
from __future__ import annotations

import pytest

from megatron_ppo.parallel.launch import LocalWorkerPool


def _cycle(rank, world_size, tp):
    import os

    import torch
    import torch.distributed as dist

    from megatron_ppo import parallel

    parallel.initialize(tp=tp, pp=1, seed=1)
    t = torch.ones(2)
    dist.all_reduce(t)
    parallel.destroy(destroy_process_group=False)
    return len(os.listdir("/proc/self/task"))


@pytest.mark.slow  # a 2-rank pool: ~15 s
def test_reinitialising_layouts_on_a_live_world_does_not_leak_threads():
    with LocalWorkerPool(2) as pool:
        counts = [pool.run(_cycle, tp) for tp in (2, 1, 2, 1, 2)]
    first, last = counts[0], counts[-1]
    assert last == first, f"threads per rank after each layout: {counts}"
