"""The console of a short real run (issue 15): library noise off, "step i/N" per step, and at the end the paths of
what the run wrote. A real `megatron-ppo train` process (in-process ranks, 2 steps)."""
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
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *LOCAL,
                           f"trainer.log_dir={tmp_path}/logs"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OptimizerConfig" not in proc.stderr and "DistributedDataParallelConfig" not in proc.stderr
    assert "bucket" not in proc.stderr.lower(), proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/2", "2/2"], proc.stdout
    assert all(len(s) < 160 and "reward" in s for s in steps), steps
    assert "wrote:" in proc.stdout and f"{tmp_path}/logs/metrics.jsonl" in proc.stdout, proc.stdout
    assert len(proc.stderr.splitlines()) <= 15, proc.stderr
