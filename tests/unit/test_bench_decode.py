"""tools/bench_decode.py's arithmetic and bookkeeping, without a model: the bandwidth floor, the KV cache's bytes, the
host-read count on a made-up profile and on a real torch.profiler one, the derived per-step numbers, the goals and the
table (the whole script runs on the CPU in gpu_check.sh's dry run: tests/unit/test_gpu_check_script.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_decode as bd  # noqa: E402 (a tool, not a package)

from megatron_ppo.testing import gpu_step  # noqa: E402


def test_cases_parse_and_bad_ones_are_refused():
    assert bd.parse_case("64x256") == (64, 256) and bd.parse_case("4X8") == (4, 8)
    for bad in ("64", "64x", "ax2", "0x8", "4x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bd.parse_case(bad)


def test_bandwidth_by_device_name_and_the_floor_of_the_0p5b_model():
    assert bd.bandwidth_gbs("NVIDIA H200") == 4800
    assert bd.bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350
    assert bd.bandwidth_gbs("NVIDIA H100 PCIe") == 2000 and bd.bandwidth_gbs("NVIDIA H100 NVL") == 3900
    assert bd.bandwidth_gbs("cpu") == bd.DEFAULT_BANDWIDTH_GBS == 3350
    assert bd.bandwidth_gbs("NVIDIA H200", override=1000) == 1000
    n = gpu_step.arch("qwen2-0.5b").num_parameters()
    assert n == gpu_step.QWEN2_0P5B_PARAMS
    assert bd.floor_ms(2 * n, 3350) == pytest.approx(2 * 494_032_768 / 3350e9 * 1e3)  # ~0.295 ms on an H100 SXM
    assert bd.floor_ms(2 * n, 4800) == pytest.approx(0.2058, abs=1e-4)
    with pytest.raises(ValueError):
        bd.floor_ms(1.0, 0)


def test_kv_cache_bytes_of_the_static_cache():
    arch = gpu_step.arch("qwen2-0.5b")  # 24 layers, 2 KV groups of head_dim 64
    assert bd.kv_cache_bytes(arch, 64, 384, 2) == 2 * 24 * 2 * 64 * 64 * 384 * 2  # ~302 MB: as much as 1/3 the weights


def ev(name, start, end, parent=None):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent)


def made_up_profile(with_loop_range: bool):
    gen = ev("bench/generate", 0, 1000)
    pre = ev("generate/prefill", 10, 100, gen)
    events = [gen, pre, ev("aten::item", 20, 21, pre)]  # a prefill read: not the decode loop's
    item = ev("aten::item", 200, 202, gen)
    events += [item, ev("aten::_local_scalar_dense", 200.5, 201, item)]  # one read, not two
    events += [ev("aten::is_nonzero", 300, 301, gen), ev("aten::nonzero", 400, 405, gen), ev("aten::mm", 500, 510, gen)]
    if with_loop_range:
        events.append(ev("generate/decode_loop", 150, 350, gen))  # the nonzero at 400 is after the loop
    return events


def test_host_reads_are_counted_once_each_inside_the_decode_loop():
    events = made_up_profile(False)
    assert bd.decode_window(events) == (100, 1000)
    assert bd.host_reads(events, bd.decode_window(events)) == {"aten::item": 1, "aten::is_nonzero": 1,
                                                              "aten::nonzero": 1}
    assert bd.host_reads(events) == {"aten::item": 2, "aten::is_nonzero": 1, "aten::nonzero": 1}
    events = made_up_profile(True)
    assert bd.decode_window(events) == (150, 350)
    assert bd.host_reads(events, bd.decode_window(events)) == {"aten::item": 1, "aten::is_nonzero": 1}
    assert bd.decode_window([ev("aten::mm", 0, 1)]) is None


def test_host_reads_on_a_real_profile():
    """The op names and the parent links torch.profiler really gives: ``int(t)`` is aten::item over
    aten::_local_scalar_dense (one read), a boolean index is an aten::nonzero (one read)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.arange(10.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("bench/generate"):
            with record_function("generate/prefill"):
                int(x.sum())
            for _ in range(3):
                int(x.sum())  # three reads after the prefill
            x[x > 4].sum()  # a nonzero under aten::index
    events = prof.events()
    counts = bd.host_reads(events, bd.decode_window(events))
    assert counts.get("aten::item") == 3 and sum(counts.values()) == 4, counts


def test_derived_numbers_goals_and_table():
    d = bd.derive(64, 256, wall_s=1.0, prefill_s=0.235, floor=0.3)
    assert d["decode_steps"] == 255 and d["tokens_per_s"] == pytest.approx(16384)
    assert d["ms_per_step"] == pytest.approx(3.0) and d["x_floor"] == pytest.approx(10.0)
    sys_ok = {"tokens_per_s": 25000.0, "ms_per_step": 2.5, "wall_s": 0.66, "prefill_s": 0.05, "x_floor": 8.3,
              "host_reads_per_step": 0.125, "capped": False, "new_tokens_run": 256}
    eager = dict(sys_ok, tokens_per_s=1200.0, ms_per_step=50.0, capped=True, new_tokens_run=64,
                 tokens_per_s_full_est=1250.0, host_reads_per_step=3.0)
    cases = [{"case": "64x256", "new": 256, "systems": {"eager": eager, "static": dict(sys_ok, tokens_per_s=9000.0),
                                                         "graphs": sys_ok}},
             {"case": "256x512", "new": 512, "systems": {"graphs": {"error": "RuntimeError: capture failed"},
                                                          "static": dict(sys_ok, tokens_per_s=30000.0)}}]
    goals = bd.goal_results(cases)
    assert [(g["system"], g["met"]) for g in goals] == [("graphs", True), ("static", False), ("graphs", True)]
    assert bd.goal_results([])[0]["met"] is None
    table = bd.markdown({"cases": cases, "goals": goals})
    assert "| 64x256 | eager (at 64 tokens) | 1200 |" in table and "timed at 64 of 256 new tokens" in table
    assert "| 256x512 | graphs | **error**: RuntimeError: capture failed |" in table
    assert "goal tokens/s at 256 x 512 >= 40000: 30000 (static), **not met**" in table
