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
    """Preflight's input checks are cheap by construction: neither torch nor Megatron nor Ray is imported by them
    (only its last checks, cluster.device and the layout arithmetic, import torch, which the run imports next)."""
    path = write_rows(tmp_path / "t.parquet")
    code = textwrap.dedent(f"""
        import sys
        from megatron_ppo.config import load_config
        from megatron_ppo.trainer.preflight import run_preflight
        cfg = load_config("tiny_cpu", {[*BASE, f"data.train_files={path}", f"trainer.log_dir={tmp_path}/l"]!r})
        run_preflight(cfg, machine=False)
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


# Issue 22, item 4: a layout that cannot split an HF model. SmolLM2-135M-Instruct's config.json (9 attention heads,
# 3 KV heads, 30 layers) at tiny_cpu's TP2 used to pass preflight, start Ray and every rank, and stop with
# "actor rank 1 ... raised ValueError: num_attention_heads=9 is not divisible by tensor parallel size 2 (in 'setup')".
SMOL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
               "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
               "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000,
               "tie_word_embeddings": True, "hidden_act": "silu"}
HF_LIMIT_S = 60  # seconds, not the minute-plus of Ray start-up and model building (the check itself takes ~0.3 s)


def tripwire(tmp_path) -> list[str]:
    """Overrides refused right after preflight (trainer/entry.py: a missing checkpoint, before Ray): should the layout
    check regress, these tests fail in seconds with another message instead of starting Ray and ranks."""
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/no_checkpoint"]


def smol_yaml(tmp_path) -> tuple[Path, Path]:
    """A user's YAML: tiny_cpu (actor and ref TP2) with actor.model.path an HF directory (config.json only:
    preflight reads no weights)."""
    import json

    from megatron_ppo.config import yaml_dump, yaml_load

    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOL_CONFIG))
    data = yaml_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    data["actor"]["model"] = {"path": str(model), "dtype": "float32"}
    path = tmp_path / "smol.yaml"
    path.write_text(yaml_dump(data))
    return path, model


def test_hf_model_that_tp_cannot_split_exits_2_before_ray(tmp_path):
    config, model = smol_yaml(tmp_path)
    proc, s = train(tmp_path, f"data.train_files={write_rows(tmp_path / 't.parquet')}", *tripwire(tmp_path),
                    args=["--config", str(config)])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for text in ("cluster.actor.tensor_model_parallel_size=2", f"actor.model.path={model}",
                 "num_attention_heads=9 and num_key_value_heads=3 are not divisible by 2", str(model / "config.json"),
                 "set cluster.actor.tensor_model_parallel_size to 1 or 3"):
        assert text in proc.stderr, (text, proc.stderr)
    assert s < HF_LIMIT_S, s
    assert not (tmp_path / "logs").exists()  # nothing claimed, no run started


def test_hf_layout_refusal_starts_no_ray_and_no_process(tmp_path):
    """The entry function itself: PreflightError before torch, Ray or any rank (no child process of the driver)."""
    config, _ = smol_yaml(tmp_path)
    code = textwrap.dedent(f"""
        import os, sys
        from megatron_ppo.trainer.entry import main
        from megatron_ppo.trainer.preflight import PreflightError
        try:
            main(["--config", {str(config)!r}, *{[*BASE, f"trainer.log_dir={tmp_path}/logs", *tripwire(tmp_path)]!r}])
        except PreflightError as exc:
            assert "cluster.actor.tensor_model_parallel_size=2" in str(exc), exc
        else:
            raise AssertionError("no PreflightError")
        heavy = sorted(m for m in ("torch", "megatron", "ray") if m in sys.modules)
        assert not heavy, heavy
        tasks = [f"/proc/self/task/{{t}}/children" for t in os.listdir("/proc/self/task")]
        children = [c for f in tasks if os.path.exists(f) for c in open(f).read().split()]  # (a Linux kernel option)
        assert not children, children
    """)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@pytest.mark.parametrize("tp", [1, 3])
def test_hf_model_at_tp_dividing_its_heads_passes_dry_run(tmp_path, tp):
    config, _ = smol_yaml(tmp_path)
    layout = [f"cluster.{r}.tensor_model_parallel_size={tp}" for r in ("actor", "ref", "critic")]
    data = write_rows(tmp_path / "t.parquet")
    proc, _ = train(tmp_path, f"data.train_files={data}", f"cluster.n_gpus_per_node={2 * tp}",
                    "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4", *layout,
                    args=["--config", str(config), "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    assert "preflight: ok" in proc.stdout and f"actor  TP={tp} PP=1" in proc.stdout, proc.stdout


def test_hf_model_pp_not_dividing_layers_is_refused_by_dry_run(tmp_path):
    config, model = smol_yaml(tmp_path)
    proc, s = train(tmp_path, f"data.train_files={write_rows(tmp_path / 't.parquet')}", "cluster.n_gpus_per_node=4",
                    "cluster.actor.tensor_model_parallel_size=1", "cluster.actor.pipeline_model_parallel_size=4",
                    "cluster.ref.tensor_model_parallel_size=1", "cluster.ref.pipeline_model_parallel_size=4",
                    "actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=2",
                    args=["--config", str(config), "--dry-run"])
    assert proc.returncode == 2, proc.stderr
    for text in ("cluster.actor.pipeline_model_parallel_size=4", "num_hidden_layers=30 is not divisible by 4",
                 str(model / "config.json"), "one of 1, 2, 3, 5, 6, 10, 15 or 30"):
        assert text in proc.stderr, (text, proc.stderr)
    assert s < HF_LIMIT_S, s
