"""MFU and the per-step performance metrics (megatron_ppo/perf.py) against hand counts; the device peaks."""
from __future__ import annotations

import pytest

from megatron_ppo.perf import device_peak_flops, mfu, step_perf_metrics


def test_peaks_by_device_name_and_the_override():
    assert device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak_flops("NVIDIA H200") == 989e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak_flops("NVIDIA B200") == 2250e12
    assert device_peak_flops(None) is None and device_peak_flops("Tesla T4") is None  # MFU not reported
    assert device_peak_flops(None, 100.0) == 100e12 and device_peak_flops("NVIDIA H100", 500.0) == 500e12


def test_step_metrics_by_hand():
    """A step of 10 s over 4 devices with 8,000 tokens (2,000 generated in a 4 s gen), an actor of 1e9 parameters
    updated for 2 s over 2 epochs on 2 GPUs, a critic of 5e8 for 1 s on 2 GPUs, at a 1e15 FLOP/s peak."""
    timings = {"timing/step": 10.0, "timing/gen": 4.0, "timing/update_actor": 2.0, "timing/update_critic": 1.0}
    got = step_perf_metrics(timings, 8000, 2000, {"actor": 10 ** 9, "critic": 5 * 10 ** 8},
                            {"actor": 2, "critic": 2}, {"actor": 2, "critic": 1}, 1e15, 4)
    assert got["perf/throughput"] == pytest.approx(8000 / 10 / 4)
    assert got["perf/rollout_tokens_per_s"] == pytest.approx(2000 / 4)
    assert got["perf/mfu/actor"] == pytest.approx(6 * 1e9 * 8000 * 2 / 2.0 / (1e15 * 2))  # 0.024
    assert got["perf/mfu/critic"] == pytest.approx(6 * 5e8 * 8000 / 1.0 / (1e15 * 2))
    assert mfu(10 ** 9, 8000, 2.0, 1e15, gpus=2, passes=2) == got["perf/mfu/actor"]


def test_no_mfu_without_a_peak_or_an_update():
    timings = {"timing/step": 1.0, "timing/update_critic": 1.0}  # critic warmup: no actor update this step
    got = step_perf_metrics(timings, 100, 10, {"actor": 10, "critic": 10}, {"actor": 1, "critic": 1}, {}, None, 1)
    assert not any(k.startswith("perf/mfu") for k in got)  # CPU without trainer.peak_tflops
    got = step_perf_metrics(timings, 100, 10, {"actor": 10, "critic": 10}, {"actor": 1, "critic": 1}, {}, 1e12, 1)
    assert "perf/mfu/critic" in got and "perf/mfu/actor" not in got
    with pytest.raises(ValueError, match="must be positive"):
        mfu(10, 10, 0.0, 1e12)


def test_nsys_on_ray_runs_each_profiled_rank_under_nsight_with_the_capture_range():
    """tool=nsys on a GPU: the chosen ranks' Ray runtime_env starts them under nsys, recording only inside the
    cudaProfilerStart/Stop ranges they open; nothing off a GPU or with another tool."""
    from megatron_ppo.config import load_config
    from megatron_ppo.profiling import nsight_runtime_envs

    cfg = load_config("tiny_cpu", ["global_profiler.tool=nsys", "global_profiler.steps=[3]",
                                   "global_profiler.ranks=[0,1,5]", "trainer.log_dir=/runs/x"])
    envs = nsight_runtime_envs(cfg, "actor", 2, on_gpu=True)
    assert sorted(envs) == [0, 1]  # rank 5 is not in a 2-rank role
    assert envs[1] == {"nsight": {"t": "cuda,nvtx,osrt,cublas,cudnn", "capture-range": "cudaProfilerApi",
                                  "capture-range-end": "repeat", "o": "/runs/x/profile/actor_rank1"}}
    assert nsight_runtime_envs(cfg, "actor", 2, on_gpu=False) == {}
    torch_cfg = load_config("tiny_cpu", ["global_profiler.tool=torch", "global_profiler.steps=[3]"])
    assert nsight_runtime_envs(torch_cfg, "actor", 2, on_gpu=True) == {}
