"""Preflight (issue 15): every input error of `megatron-ppo train` is one line naming the key/file/row, exit 2,
in seconds and before any model is built. Real processes, real parquet files."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_ppo.data.schema import GSM8K_PROMPT_SCHEMA

REPO = Path(__file__).resolve().parents[2]
# preflight only: nothing is preprocessed or built; the data comes from each test
BASE = ["data.preprocess.dataset=null", "data.val_files=[]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[console,jsonl]"]
LIMIT_S = 10  # the target is 5 s; the shared 2-core test machine is often loaded several times over


def write_rows(path: Path, n: int = 32, mutate=None, schema=GSM8K_PROMPT_SCHEMA) -> Path:
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i, "answer": f"#### {i + 1}", "question": f"What is {i} + 1?"}}
            for i in range(n)]
    if mutate:
        rows = [mutate(dict(r)) for r in rows]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def train(tmp_path, *overrides, args=()):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *args, *BASE,
                           f"trainer.log_dir={tmp_path}/logs", *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    return proc, time.monotonic() - start


def assert_input_error(proc, seconds, *names):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr
    for name in names:
        assert name in proc.stderr, (name, proc.stderr)
    assert seconds < LIMIT_S, seconds


def test_missing_train_file(tmp_path):
    proc, s = train(tmp_path, f"data.train_files={tmp_path}/nope.parquet")
    assert_input_error(proc, s, "data.train_files[0]", "nope.parquet")


def test_not_a_parquet_file(tmp_path):
    bad = tmp_path / "train.parquet"
    bad.write_text("question,answer\n1,2\n")
    proc, s = train(tmp_path, f"data.train_files={bad}")
    assert_input_error(proc, s, "data.train_files", str(bad), "not a parquet file")


def test_missing_reward_model_column(tmp_path):
    schema = pa.schema([f for f in GSM8K_PROMPT_SCHEMA if f.name != "reward_model"])
    path = write_rows(tmp_path / "t.parquet", mutate=lambda r: {k: v for k, v in r.items() if k != "reward_model"},
                      schema=schema)
    proc, s = train(tmp_path, f"data.train_files={path}")
    assert_input_error(proc, s, "data.train_files", str(path), "'reward_model'")
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()  # refused before the log dir is claimed


def test_null_ground_truth_names_row(tmp_path):
    def drop_third(r):
        if r["extra_info"]["index"] == 2:
            r["reward_model"] = {"style": "rule", "ground_truth": None}
        return r

    path = write_rows(tmp_path / "t.parquet", mutate=drop_third)
    proc, s = train(tmp_path, f"data.train_files={path}")
    assert_input_error(proc, s, "ground_truth", "row 2", str(path))


def test_empty_parquet(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(GSM8K_PROMPT_SCHEMA.empty_table(), path)
    proc, s = train(tmp_path, f"data.train_files={path}")
    assert_input_error(proc, s, "data.train_files", str(path), "no rows")


def test_batch_larger_than_data_names_keys_and_file(tmp_path):
    path = write_rows(tmp_path / "t.parquet", n=4)
    proc, s = train(tmp_path, f"data.train_files={path}", "data.train_batch_size=8")
    assert_input_error(proc, s, "data.train_batch_size=8", "4 rows", str(path))


def test_unknown_data_source(tmp_path):
    path = write_rows(tmp_path / "t.parquet", mutate=lambda r: {**r, "data_source": "my/dataset"})
    proc, s = train(tmp_path, f"data.train_files={path}")
    assert_input_error(proc, s, "'my/dataset'", "reward.custom_reward_function.path")


def test_custom_reward_path_missing(tmp_path):
    path = write_rows(tmp_path / "t.parquet")
    proc, s = train(tmp_path, f"data.train_files={path}", f"reward.custom_reward_function.path={tmp_path}/r.py")
    assert_input_error(proc, s, "reward.custom_reward_function.path", "r.py")


def test_custom_reward_wrong_signature(tmp_path):
    path = write_rows(tmp_path / "t.parquet")
    (tmp_path / "r.py").write_text("def compute_score(solution_str):\n    return 0.0\n")
    proc, s = train(tmp_path, f"data.train_files={path}", f"reward.custom_reward_function.path={tmp_path}/r.py")
    assert_input_error(proc, s, "reward.custom_reward_function", "compute_score(solution_str)")


def test_unwritable_log_dir(tmp_path):
    path = write_rows(tmp_path / "t.parquet")
    (tmp_path / "afile").write_text("")
    proc, s = train(tmp_path, f"data.train_files={path}", f"trainer.log_dir={tmp_path}/afile/logs")
    assert_input_error(proc, s, "trainer.log_dir", "not a directory")


def test_wandb_without_login(tmp_path, monkeypatch):
    path = write_rows(tmp_path / "t.parquet")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *BASE, f"data.train_files={path}",
                           f"trainer.log_dir={tmp_path}/logs", "trainer.logger=[console,wandb]"], cwd=REPO,
                          capture_output=True, text=True, env={**env, "HOME": str(home)}, timeout=300)
    assert_input_error(proc, time.monotonic() - start, "trainer.logger", "wandb")


def test_actor_model_path_missing(tmp_path):
    path = write_rows(tmp_path / "t.parquet")
    proc, s = train(tmp_path, f"data.train_files={path}", "actor.model.arch=null", f"actor.model.path={tmp_path}/m")
    assert_input_error(proc, s, "actor.model.path", f"{tmp_path}/m")


def test_unsupported_model_architecture(tmp_path):
    path = write_rows(tmp_path / "t.parquet")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "gpt2"}')
    proc, s = train(tmp_path, f"data.train_files={path}", "actor.model.arch=null", f"actor.model.path={tmp_path}/m")
    assert_input_error(proc, s, "actor.model.path", "'gpt2'")


def test_preflight_imports_no_model_code(tmp_path):
    """Preflight is cheap by construction: neither torch nor Megatron nor Ray is imported by it."""
    path = write_rows(tmp_path / "t.parquet")
    code = textwrap.dedent(f"""
        import sys
        from megatron_ppo.config import load_config
        from megatron_ppo.trainer.preflight import run_preflight
        cfg = load_config("tiny_cpu", {[*BASE, f"data.train_files={path}", f"trainer.log_dir={tmp_path}/l"]!r})
        run_preflight(cfg)
        heavy = sorted(m for m in ("torch", "megatron", "ray", "transformers") if m in sys.modules)
        assert not heavy, heavy
    """)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_dry_run_prints_plan_and_builds_nothing(tmp_path):
    path = write_rows(tmp_path / "t.parquet", n=64)
    proc, s = train(tmp_path, f"data.train_files={path}", "trainer.total_training_steps=3",
                    args=["--dry-run"])
    assert proc.returncode == 0, proc.stderr
    for text in ("preflight: ok", "64 train rows", "TP=", "steps: 3", "prompts x rollout.n="):
        assert text in proc.stdout, (text, proc.stdout)
    assert not (tmp_path / "logs").exists()  # nothing claimed or written
