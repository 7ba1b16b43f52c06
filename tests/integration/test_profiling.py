"""global_profiler and the per-step performance metrics through a real `megatron-ppo train` (in-process ranks, the
tiny default): tool=torch writes a chrome trace and a key-averages table for exactly the chosen step, with the
driver's phases and the roles' calls, micro-batch forwards, schedules and optimizer steps named inside; tool=nsys
opens and closes the capture range (cudaProfilerStart/Stop on a GPU) at exactly the chosen steps, read through the
test hook every process appends to; perf/throughput every step, perf/mfu/<role> once a peak is known. The ranks'
own traces on Ray: test_ppo_ray.py's critic-warmup run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL = ["cluster.launcher=local", "cluster.actor.tensor_model_parallel_size=1",
         "cluster.ref.tensor_model_parallel_size=1", "cluster.critic.data_parallel_size=1",
         "cluster.actor.data_parallel_size=1", "cluster.ref.data_parallel_size=1",
         "trainer.test_freq=-1", "trainer.val_before_train=false"]
PHASES = ("ppo/step", "ppo/gen", "ppo/reward", "ppo/old_log_prob", "ppo/adv", "ppo/update_critic", "ppo/update_actor",
          "ppo/sync_weights", "actor/generate", "actor/update", "actor/forward", "actor/forward_backward",
          "actor/optimizer_step", "critic/update", "critic/forward_only", "ref/compute_log_probs")


def _train(tmp_path: Path, steps: int, *extra: str, env: dict | None = None) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *LOCAL,
                           f"trainer.total_training_steps={steps}", f"trainer.log_dir={tmp_path}/logs", *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").open()]


@pytest.mark.slow
def test_torch_traces_for_exactly_the_chosen_step_with_every_phase_named_and_mfu(tmp_path):
    steps = _train(tmp_path, 2, "global_profiler.tool=torch", "global_profiler.steps=[2]", "trainer.peak_tflops=1")
    root = tmp_path / "logs" / "profile"
    assert sorted(os.listdir(root)) == ["step2"]  # step 1 was not profiled
    assert sorted(os.listdir(root / "step2")) == ["driver.key_averages.txt", "driver.pt.trace.json"]
    names = {e.get("name") for e in json.loads((root / "step2" / "driver.pt.trace.json").read_text())["traceEvents"]}
    assert not [p for p in PHASES if p not in names], sorted(n for n in names if n and "/" in n)[:40]
    table = (root / "step2" / "driver.key_averages.txt").read_text()
    assert "ppo/update_actor" in table and "Self CPU" in table
    for s in steps:  # every step; MFU because trainer.peak_tflops gave a peak (on a GPU: the device's)
        assert s["perf/throughput"] > 0 and s["perf/rollout_tokens_per_s"] > 0
        assert 0 < s["perf/mfu/actor"] < 1 and 0 < s["perf/mfu/critic"] < 1
    assert "perf/max_memory_allocated_gb/actor" not in steps[0]  # a GPU's allocator peaks: none on the CPU


@pytest.mark.slow
def test_nsys_capture_range_opens_and_closes_at_exactly_the_chosen_steps(tmp_path):
    events = tmp_path / "events.txt"
    steps = _train(tmp_path, 3, "global_profiler.tool=nsys", "global_profiler.steps=[1,3]",
                   env={"MEGATRON_PPO_PROFILE_EVENTS": str(events)})
    assert len(steps) == 3 and "perf/mfu/actor" not in steps[0]  # CPU, no trainer.peak_tflops: no peak, no MFU
    assert events.read_text().splitlines() == ["start driver 1", "stop driver 1", "start driver 3", "stop driver 3"]
    assert not (tmp_path / "logs" / "profile").exists()  # nsys writes its own report; nothing of ours
