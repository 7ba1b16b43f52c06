"""The console of a short real run (issue 15): library noise off, "step i/N" per step, and at the end the paths of
what the run wrote. A real `megatron-ppo train` process (in-process ranks, 2 steps).

Before step 1 (issue 49: the SmolLM2 recipe printed nothing for ~6.5 minutes), one line as each phase begins: the
data, building the roles (from which weights, which engine), validation before training (its size, a line a batch,
its duration), training."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL = ["cluster.launcher=local", "cluster.actor.tensor_model_parallel_size=1",
         "cluster.ref.tensor_model_parallel_size=1", "cluster.critic.data_parallel_size=1",
         "cluster.actor.data_parallel_size=1", "cluster.ref.data_parallel_size=1",
         "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]


@pytest.mark.slow
def test_two_step_run_console(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *LOCAL, "trainer.val_before_train=true",
                           f"trainer.log_dir={tmp_path}/logs"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OptimizerConfig" not in proc.stderr and "DistributedDataParallelConfig" not in proc.stderr
    assert "bucket" not in proc.stderr.lower(), proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/2", "2/2"], proc.stdout
    assert all(len(s) < 160 and "reward" in s for s in steps), steps
    assert "wrote:" in proc.stdout and f"{tmp_path}/logs/metrics.jsonl" in proc.stdout, proc.stdout
    phases = [line.split("megatron_ppo.trainer.progress: ", 1)[1] for line in proc.stderr.splitlines()
              if "megatron_ppo.trainer.progress: " in line]
    assert [p.split(":")[0] for p in phases] == ["data", "building the roles in this process",
                                                 "validation before training", "validation before training",
                                                 "training"], proc.stderr
    assert phases[0].startswith("data: 2048 train prompts, 32 validation prompts (read and checked in "), phases
    assert "actor, critic, ref with random weights" in phases[1] and "rollout engine: megatron" in phases[1], phases
    assert phases[2].startswith("validation before training: 32 prompts in 1 batch of 32 (greedy"), phases
    assert phases[3].startswith("validation before training: 32 prompts in ") and phases[3].endswith(" s"), phases
    assert phases[4].startswith("training: steps 1-2 of 16 prompts x 1 response(s)"), phases
    assert proc.stdout.splitlines()[0].startswith("validation before training  val/"), proc.stdout
    others = [line for line in proc.stderr.splitlines() if "megatron_ppo.trainer.progress: " not in line]
    assert len(others) <= 15, proc.stderr
