"""The CPU platform layer and parallel.initialize/destroy in one process (world of one)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform layer is inactive with CUDA")]


@pytest.fixture
def platform():
    from megatron_ppo.parallel import platform as p

    assert p.enable_cpu_platform() is True
    yield p
    p.disable_cpu_platform()


def test_shims_remap_cuda_requests_to_cpu(platform):
    assert platform.cpu_platform_enabled()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu" and torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.tensor([1], pin_memory=True).is_pinned() is False
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.query() and start.elapsed_time(end) >= 0
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
    # numerics are untouched: same values with and without the mode
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x.cuda() @ x.t(), x @ x.t())


def test_disable_restores_torch(platform):
    platform.disable_cpu_platform()
    assert not platform.cpu_platform_enabled()
    assert torch.ones(2).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    platform.enable_cpu_platform()  # the fixture disables again


def test_rng_tracker_forks_cpu_generator_states(platform):
    from megatron.core import tensor_parallel

    from megatron_ppo import parallel

    parallel.initialize(seed=5)
    try:
        tracker = tensor_parallel.get_cuda_rng_tracker()
        with tracker.fork():
            a = torch.rand(4)
        outside = torch.rand(4)
        parallel.seed_everything(5)
        with tracker.fork():
            a2 = torch.rand(4)
        assert torch.equal(a, a2) and not torch.equal(a, outside)
        assert tracker is tensor_parallel.get_cuda_rng_tracker()
        parallel.seed_everything(5)
        with tracker.fork():
            torch.rand(4)
        assert torch.equal(torch.rand(4), outside)  # fork() leaves the default generator where it was
    finally:
        parallel.destroy()


def test_initialize_destroy_reinitialise_and_errors(platform):
    from megatron.core import parallel_state

    from megatron_ppo import parallel

    for _ in range(2):
        parallel.initialize(tp=1, pp=1, seed=1)
        assert parallel.is_initialized() and parallel.dp_size() == 1 and parallel.tp_size() == 1
        assert parallel.is_first_stage() and parallel.is_last_stage()
        with pytest.raises(RuntimeError, match="already initialised"):
            parallel.initialize()
        parallel.destroy()
        assert not parallel.is_initialized() and not parallel_state.model_parallel_is_initialized()
        assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="not divisible by tp"):
        parallel.initialize(tp=2)
    parallel.destroy()
    with pytest.raises(ValueError, match="tp must be a positive int"):
        parallel.initialize(tp=0)
    with pytest.raises(ValueError, match="nccl"):
        parallel.initialize(backend="nccl")
    with pytest.raises(NotImplementedError, match="context parallel"):
        parallel.initialize(cp=2)
