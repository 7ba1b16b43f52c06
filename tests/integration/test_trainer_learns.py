"""The default config learns: `make train`'s run (configs/tiny_cpu.yaml, the generated arithmetic task, Ray
layout) raises the mean reward; and the task itself: GSM8K-format rows the rule reward scores, text the small BPE
covers. The 3-seed measurement is tools/bench_learning.py (docs/bench/learning.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]


def test_arithmetic_task_is_gsm8k_format_and_scored_by_the_rule_reward(tmp_path):
    from megatron_ppo.data.preprocess import main
    from megatron_ppo.data.tokenizer import gsm8k_tokenizer
    from megatron_ppo.rewards.gsm8k import compute_score

    assert main(["arithmetic", "--out", str(tmp_path), "--train-rows", "50", "--test-rows", "5", "--seed", "3"]) == 0
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 50 and len(pq.read_table(tmp_path / "test.parquet")) == 5
    assert json.loads((tmp_path / "preprocess_manifest.json").read_text())["dataset"] == "arithmetic"
    tok = gsm8k_tokenizer(tmp_path / "tok", vocab_size=300)
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    for r in rows:
        q, truth = r["extra_info"]["question"], r["reward_model"]["ground_truth"]
        a, b = (int(x) for x in q.removeprefix("What is ").removesuffix("?").split(" + "))
        assert truth == str(a + b) and 0 <= a + b <= 9 and r["data_source"] == "openai/gsm8k"
        assert "####" in r["prompt"][0]["content"]
        assert compute_score(f"#### {truth}", truth, mode="numeric") == 1.0
        assert compute_score(f"#### {(a + b + 1) % 10}", truth, mode="numeric", format_score=0.2) == 0.2
        ids = tok.encode(q)
        assert tok.decode(ids) == q  # the tokenizer covers the task's text
        assert {tok.convert_tokens_to_ids(str(a)), tok.convert_tokens_to_ids(str(b))} <= set(ids) & digits
    # deterministic in the seed
    assert main(["arithmetic", "--out", str(tmp_path / "again"), "--train-rows", "50", "--test-rows", "5",
                 "--seed", "3"]) == 0
    assert pq.read_table(tmp_path / "again" / "train.parquet").to_pylist() == rows


@pytest.mark.slow
def test_make_train_default_raises_the_reward(tmp_path):
    """The default config as `make train` runs it (Ray, actor/ref TP2, critic DP2), shortened to 20 steps: the
    mean reward of the last 5 steps beats the first 5 by > 0.05 (the full 30-step, 3-seed margins are in
    docs/bench/learning.md); the run directory holds the record and the curves."""
    log_dir = tmp_path / "logs"
    out = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
                          "trainer.total_training_steps=20", f"trainer.log_dir={log_dir}",
                          f"data.preprocess.output_dir={tmp_path / 'data'}",
                          f"data.train_files=[{tmp_path / 'data'}/train.parquet]",
                          f"data.val_files=[{tmp_path / 'data'}/test.parquet]"],
                         check=True, cwd=REPO, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    recs = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/score/mean"] for r in recs if "reward/score/mean" in r]
    assert len(rewards) == 20
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards
    for name in ("config.yaml", "versions.json", "layout.json", "curves.png", "curves/reward.png"):
        assert (log_dir / name).is_file(), name
    assert f"curves: {log_dir / 'curves.png'}" in out.stdout
    assert json.loads((log_dir / "layout.json").read_text())["roles"]["actor"]["tp"] == 2
