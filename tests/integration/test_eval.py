"""`megatron-ppo eval`: the numbers of `train`'s validation on the same model and prompts (a trainer checkpoint),
an HF directory scored against transformers' own greedy generate + the reward rule, and refusals by name."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ppo.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_eval_of_a_checkpoint_equals_train_validation_of_the_same_weights(tmp_path):
    """Train one step (validation after it, checkpoint of it), then eval the checkpoint on the same prompts: the
    same mean reward per data source, and accuracy / format rate consistent with the rule's scores."""
    data = tmp_path / "data"
    val = [f"data.preprocess.output_dir={data}", f"data.val_files=[{data / 'test.parquet'}]",
           "data.val_max_samples=12", "data.val_batch_size=6"]
    run = _cli("train", *val, f"data.train_files=[{data / 'train.parquet'}]", "data.train_batch_size=4",
               "data.train_max_samples=8", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
               "actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
               "trainer.total_training_steps=1", "trainer.val_before_train=true", "trainer.test_freq=1",
               "actor.optim.lr=0.3",  # a step large enough that the greedy answers change (else a missing load passes)
               "trainer.save_freq=1", "trainer.logger=[jsonl]", f"trainer.log_dir={tmp_path / 'logs'}",
               f"trainer.default_local_dir={tmp_path / 'ckpt'}",
               # in-process ranks (train, then eval from the checkpoint's config.yaml, at the same layout)
               "cluster.launcher=local", "cluster.actor.tensor_model_parallel_size=1",
               "cluster.ref.tensor_model_parallel_size=1", "cluster.critic.data_parallel_size=1")
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    before, record = records[0], records[-1]
    validated = {k.split("/", 2)[2]: v for k, v in record.items() if k.startswith("val/test_score/")}
    assert validated, record.keys()
    assert before["step"] == 0 and any(before[f"val/test_score/{k}"] != v for k, v in validated.items()), \
        "the step did not change the validation score: the test could not tell trained from initial weights"
    actor = tmp_path / "ckpt" / "global_step_1" / "actor"
    assert (actor.parent / "config.yaml").is_file()

    out = tmp_path / "eval"
    ev = _cli("eval", "--model", str(actor), "--data", str(data / "test.parquet"), "--n", "12", "--out", str(out),
              "--samples", "-1")
    assert ev.returncode == 0, ev.stderr[-3000:]
    doc = json.loads((out / "eval.json").read_text())
    assert doc["prompts"] == 12 and doc["n"] == 12
    for source, score in validated.items():
        assert doc["by_data_source"][source]["mean_score"] == pytest.approx(score, abs=1e-6), source  # (val: fp32)
    # tiny_cpu's reward: 1 correct, 0.2 a wrong number, 0 no number -> mean = acc + 0.2 (format - acc)
    assert doc["mean_score"] == pytest.approx(doc["accuracy"] + 0.2 * (doc["format_rate"] - doc["accuracy"]))
    lo, hi = doc["accuracy_ci95"]
    assert lo <= doc["accuracy"] <= hi
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 12 and all(s["response"] is not None for s in samples)  # --samples -1: every response
    assert sum(s["score"] for s in samples) / 12 == pytest.approx(doc["mean_score"])
    # "#### <number>" marks GSM8K's own answer format; a marked answer is also an answer to reward.method's rule
    assert all(s["strict_formatted"] is not None and s["strict_formatted"] <= s["formatted"] for s in samples)
    assert all(s["strict_formatted"] <= ("####" in s["response"]) for s in samples)
    assert doc["strict_format_rate"] == pytest.approx(sum(s["strict_formatted"] for s in samples) / 12)
    assert "accuracy" in ev.stdout and str(out / "eval.json") in ev.stdout

    # rollout.stop_pattern reaches eval: the same greedy responses, each cut at the token completing its first vowel
    stop_out = tmp_path / "eval_stop"
    ev = _cli("eval", "--model", str(actor), "--data", str(data / "test.parquet"), "--n", "12", "--out", str(stop_out),
              "--samples", "-1", "rollout.stop_pattern=[aeiou]")
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads((stop_out / "eval.json").read_text())["stop_pattern"] == "[aeiou]"
    cut = [json.loads(line)["response"] for line in (stop_out / "samples.jsonl").read_text().splitlines()]
    whole = [s["response"] for s in samples]
    for short, full in zip(cut, whole):
        assert full.startswith(short) and bool(re.search("[aeiou]", short)) == bool(re.search("[aeiou]", full))
    assert sum(len(c) < len(w) for c, w in zip(cut, whole)) >= 3, (cut, whole)

    # the step directory names the same actor, and a checkpoint of the critic is not a policy
    from megatron_ppo.evaluation.cli import checkpoint_role_dir

    assert Path(checkpoint_role_dir(str(actor.parent))) == actor
    critic = _cli("eval", "--model", str(actor.parent / "critic"), "--data", str(data / "test.parquet"))
    assert critic.returncode == 2 and "critic" in critic.stderr and "not a policy" in critic.stderr


@pytest.mark.slow
def test_eval_of_smollm2_equals_transformers_greedy_generate_and_the_rule(tmp_path):
    """SmolLM2-135M-Instruct (HF dir) on GSM8K test prompts: each response equals transformers' greedy
    generate of the same chat prompt, stopped at the model's end-of-turn token (<|im_end|>, which the GGUF's
    tokenizer got wrong), and eval's accuracy is the rule's on those texts."""
    import pyarrow.parquet as pq
    import torch
    from test_convert_smollm2 import smollm2_hf_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ppo.data.preprocess import preprocess_gsm8k
    from megatron_ppo.data.gsm8k import default_gsm8k_dir
    from megatron_ppo.rewards.gsm8k import compute_score

    hf_dir = str(smollm2_hf_dir())
    preprocess_gsm8k(default_gsm8k_dir(), tmp_path / "data")
    test = tmp_path / "data" / "test.parquet"
    n, length = 4, 48
    out = tmp_path / "eval"
    ev = _cli("eval", "--model", hf_dir, "--data", str(test), "--n", str(n), "--out", str(out),
              f"data.max_response_length={length}", "cluster.launcher=local", "trainer.logger=[console]")
    assert ev.returncode == 0, ev.stderr[-3000:]
    doc = json.loads((out / "eval.json").read_text())
    assert doc["prompts"] == n and doc["sampling"]["do_sample"] is False

    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rows = pq.read_table(test).slice(0, n).to_pylist()
    correct = []
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for row, sample in zip(rows, samples):
        ids = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=length, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        text = tok.decode(gen, skip_special_tokens=True)
        assert sample["response"] == text
        truth = row["reward_model"]["ground_truth"]
        correct.append(compute_score(text, truth, mode="numeric") == 1.0)
    assert doc["accuracy"] == pytest.approx(sum(correct) / n)


def test_eval_refuses_bad_inputs_by_name(tmp_path):
    missing = _cli("eval", "--model", str(tmp_path / "nope"), "--data", str(tmp_path))
    assert missing.returncode == 2 and "--model" in missing.stderr and "no such directory" in missing.stderr
    (tmp_path / "empty").mkdir()
    neither = _cli("eval", "--model", str(tmp_path / "empty"), "--data", str(tmp_path))
    assert neither.returncode == 2 and "neither an HF model directory" in neither.stderr
    no_data = _cli("eval", "--model", str(tmp_path / "empty"), "--data", str(tmp_path / "test.parquet"))
    assert no_data.returncode == 2 and "--data" in no_data.stderr
    bad_n = _cli("eval", "--model", str(tmp_path / "empty"), "--data", str(tmp_path), "--n", "0")
    assert bad_n.returncode == 2 and "--n" in bad_n.stderr


@pytest.mark.slow
def test_smollm2_recipe_runs_a_step_and_its_checkpoint_evaluates(tmp_path):
    """The README's real-model recipe (configs/smollm2_gsm8k.yaml) as CI can afford it: GSM8K preprocessed by the
    run, SmolLM2 as actor, reference and critic (fresh value head), one PPO step of 2 prompts x 24 tokens, a
    checkpoint; then `megatron-ppo eval` of that checkpoint. Only sizes and the launcher are overridden."""
    from test_convert_smollm2 import smollm2_hf_dir

    data, ckpt = tmp_path / "gsm8k", tmp_path / "ckpt"
    run = _cli("train", "--config", "smollm2_gsm8k", f"actor.model.path={smollm2_hf_dir()}",
               f"data.preprocess.output_dir={data}", f"data.train_files=[{data / 'train.parquet'}]",
               f"data.val_files=[{data / 'test.parquet'}]", "data.train_batch_size=2", "data.max_response_length=24",
               "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2", "trainer.total_training_steps=1",
               "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=1",
               f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.default_local_dir={ckpt}",
               "cluster.launcher=local")  # in-process ranks: the recipe's Ray start-up is tested elsewhere
    assert run.returncode == 0, run.stderr[-3000:]
    record = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["step"] == 1 and record["response_length/max"] <= 24
    for key in ("reward/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/kl_loss"):
        assert key in record and record[key] == record[key], key  # present and not NaN

    out = tmp_path / "eval"
    ev = _cli("eval", "--model", str(ckpt / "global_step_1" / "actor"), "--data", str(data / "test.parquet"),
              "--n", "2", "--out", str(out), "data.max_response_length=24")
    assert ev.returncode == 0, ev.stderr[-3000:]
    doc = json.loads((out / "eval.json").read_text())
    assert doc["prompts"] == 2 and doc["model"].rstrip("/").endswith("global_step_1/actor")  # what was evaluated


def test_a_checkpoint_of_an_offline_run_is_evaluated_online(tmp_path):
    """An offline run's checkpoint carries rollout.mode=offline and no train files; eval generates, so it runs
    online (the SmolLM2 offline benchmark's eval was refused: rollout.n must be 1 with rollout.mode=offline)."""
    from megatron_ppo.config import load_config
    from megatron_ppo.config.load import to_yaml
    from megatron_ppo.evaluation.cli import _parser, eval_config
    from megatron_ppo.models.checkpoint import META_FILE
    from megatron_ppo.trainer.checkpoint import RUN_CONFIG

    run = load_config("tiny_cpu", ["rollout.mode=offline", f"rollout.trajectory_files=[{tmp_path}]",
                                   "data.train_files=[]"])
    step = tmp_path / "global_step_3"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / META_FILE).write_text(json.dumps({"role": "actor"}))
    (step / RUN_CONFIG).write_text(to_yaml(run))
    test = tmp_path / "test.parquet"
    cfg, role_dir = eval_config(_parser().parse_args(["--model", str(step / "actor"), "--data", str(test)]))
    assert role_dir == str(step / "actor")
    assert cfg.rollout.mode == "online" and not cfg.rollout.trajectory_files
    assert list(cfg.data.val_files) == [str(test)]
