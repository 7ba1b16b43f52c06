"""Offline PPO learns (issue 13, short version of tools/bench_learning.py's "Offline" rows): the initial actor of
`make train`'s config writes a dump of mixed quality (rewards 0 / 0.2 / 1; `trainer.critic_warmup` = all steps, so
one behaviour policy wrote every row), then an offline run from the same initial weights, with
configs/gsm8k_offline.yaml's correction (token-level truncated IS, threshold 2.0), raises the online (greedy)
validation score. The dump runs with one in-process rank per role (cluster.launcher=local: how the dump is written
is not what this test is about, and Ray's ranks cost ~1.5 minutes a run); the offline run is `make train`'s Ray
layout (actor/ref TP2, critic DP2): stored rows sharded over DP ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
LOCAL = ("cluster.launcher=local", "cluster.actor.tensor_model_parallel_size=1",
         "cluster.ref.tensor_model_parallel_size=1")


def _train(tmp_path: Path, log_dir: Path, *overrides: str) -> list[dict]:
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
                    f"trainer.total_training_steps={STEPS}", "trainer.seed=0", f"trainer.log_dir={log_dir}",
                    f"data.preprocess.output_dir={data}", f"data.train_files=[{data}/train.parquet]",
                    f"data.val_files=[{data}/test.parquet]", *overrides],
                   check=True, cwd=REPO, capture_output=True, text=True, timeout=1800,
                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_offline_token_is_on_a_base_model_dump_raises_the_validation_score(tmp_path):
    dump = tmp_path / "dump"
    _train(tmp_path, tmp_path / "dump_run", f"trainer.critic_warmup={STEPS}", f"rollout.dump_dir={dump}",
           "trainer.test_freq=-1", "trainer.val_before_train=false", *LOCAL)
    rewards = [x for f in sorted(dump.glob("*.parquet")) for x in pq.read_table(f).column("reward").to_pylist()]
    assert len(rewards) == STEPS * 16 and {0.0, 1.0} <= {round(x, 6) for x in rewards}  # mixed quality

    recs = _train(tmp_path, tmp_path / "offline", "rollout.mode=offline", f"rollout.trajectory_files=[{dump}]",
                  "data.train_files=[]", "algorithm.rollout_correction.rollout_is=token",
                  "algorithm.rollout_correction.rollout_is_threshold=2.0")
    first = next(r for r in recs if r["step"] == 1)
    # behaviour = the initial actor: IS weights ~1 (the dump's TP1 log-probs vs the offline run's TP2 ones differ by
    # float32 rounding, ~1e-3 at most here)
    assert first["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=2e-3)
    assert all(r["timing/gen"] < 1.0 for r in recs if "timing/gen" in r)  # stored responses, no generation
    val = [(r["step"], r["val/test_score/openai/gsm8k"]) for r in recs if "val/test_score/openai/gsm8k" in r]
    assert val[0][0] == 0 and val[-1][0] == STEPS
    assert val[-1][1] > val[0][1], f"offline validation score did not rise: {val}"
