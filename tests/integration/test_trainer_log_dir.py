"""Through the CLI, real runs: a second `megatron-ppo train` into the same log dir is refused and leaves the first
run's metrics.jsonl as it was; with trainer.overwrite=true the file holds only the new run's records."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    overrides = [
        f"data.preprocess.output_dir={tmp / 'data'}", f"data.train_files=[{tmp / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp / 'data' / 'test.parquet'}]", "data.train_batch_size=4", "data.train_max_samples=8",
        "data.max_response_length=4", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.logger=[jsonl]", f"trainer.log_dir={tmp / 'logs'}",
        # one in-process rank per role: the log-dir rules do not depend on the launcher (no Ray start: -60 s of CI)
        "cluster.launcher=local", "cluster.actor.tensor_model_parallel_size=1", "cluster.ref.tensor_model_parallel_size=1",
        "cluster.critic.data_parallel_size=1", *extra]
    return subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *overrides], cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=900)


def _steps(tmp: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_second_run_is_refused_and_overwrite_keeps_only_the_new_run(tmp_path):
    first = _train(tmp_path, "trainer.total_training_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert _steps(tmp_path) == [1, 2]
    run_1 = json.loads((tmp_path / "logs" / "run.json").read_text())

    second = _train(tmp_path, "trainer.total_training_steps=1")
    assert second.returncode != 0
    assert "trainer.log_dir=" in second.stderr and "trainer.overwrite=true" in second.stderr
    assert "parallel" not in second.stderr.lower()  # refused before Megatron was started
    assert _steps(tmp_path) == [1, 2]

    third = _train(tmp_path, "trainer.total_training_steps=1", "trainer.overwrite=true")
    assert third.returncode == 0, third.stderr[-3000:]
    assert _steps(tmp_path) == [1]
    assert json.loads((tmp_path / "logs" / "run.json").read_text())["config_sha256"] != run_1["config_sha256"]
