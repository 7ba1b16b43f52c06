"""Offline PPO (rollout.mode=offline): an online run's dumped trajectories replayed by the driver on real
megatron-core models (CPU, gloo): identity weights when the behaviour policy is the current one, the hand-computed
truncated IS weights and rollout_corr/* metrics under a known shift, a training step on the dump, and bad
trajectory files refused naming the row."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_ppo.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _overrides(data_dir: Path, out: Path, **extra) -> list[str]:
    base = {
        "data.preprocess.output_dir": str(data_dir),
        "data.train_files": f"[{data_dir}/train.parquet]", "data.val_files": f"[{data_dir}/test.parquet]",
        "data.train_batch_size": 4, "data.val_max_samples": 4, "data.max_response_length": 8,
        "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_gpu": 4,
        "critic.ppo_mini_batch_size": 4, "critic.ppo_micro_batch_size_per_gpu": 4,
        "trainer.total_training_steps": 1, "trainer.test_freq": -1, "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]", "trainer.log_dir": str(out / "logs"),
        "cluster.launcher": "local", "cluster.n_gpus_per_node": 1,
        "cluster.actor.tensor_model_parallel_size": 1, "cluster.ref.tensor_model_parallel_size": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _offline(data_dir, out, files, **extra):
    return _overrides(data_dir, out, **{"rollout.mode": "offline", "rollout.trajectory_files": f"[{files}]",
                                        "data.train_files": "[]", **extra})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("arith")


@pytest.fixture(scope="module")
def dump(data_dir, tmp_path_factory):
    """One online step of the CLI with rollout.dump_dir: the behaviour policy is the initial actor."""
    out = tmp_path_factory.mktemp("online")
    subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train",
                    *_overrides(data_dir, out, **{"rollout.dump_dir": str(out / "dump")})],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, timeout=900)
    files = sorted((out / "dump").glob("*.parquet"))
    assert len(files) == 1
    return files[0]


def _phases(cfg, until_advantages=True):
    """Build the components and run rollout -> score -> evaluate -> advantages on all trajectory rows."""
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        try:
            trainer = PPOTrainer(cfg, parts)
            trainer.step = 1
            metrics: dict = {}
            batch = trainer.rollout(list(range(len(parts.source))))
            trainer.score(batch, metrics)
            trainer.evaluate(batch, metrics)
            trainer.compute_advantages(batch, metrics)
            return batch, metrics
        finally:
            parts.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()


@pytest.mark.slow
def test_offline_replay_weights_and_training(dump, data_dir, tmp_path):
    from megatron_ppo.data.trajectory import TrajectoryDataset

    rc = {"algorithm.rollout_correction.rollout_is": "token", "algorithm.rollout_correction.rollout_rs": "token_k1",
          "algorithm.rollout_correction.rollout_rs_threshold": 2.0}
    # 1. The behaviour log-probs are the current (initial) policy's: every IS weight 1, nothing rejected; the
    #    stored rewards are the rewards used.
    cfg = load_config("tiny_cpu", _offline(data_dir, tmp_path / "a", dump, **rc))
    batch, m = _phases(cfg)
    stored = TrajectoryDataset([dump])
    mask = batch.response_mask.bool()
    assert batch.size == len(stored) == 4
    assert m["rollout/logprob_abs_diff_max"] < 1e-4
    w = batch.tensors["rollout_is_weights"]
    assert torch.allclose(w[mask], torch.ones_like(w[mask]), atol=1e-4)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0 and torch.equal(batch.loss_mask, batch.response_mask)
    assert batch.tensors["sequence_scores"].tolist() == pytest.approx([it["reward"] for it in stored.items])
    assert m["reward/stored_fraction"] == 1.0

    # 2. A known shift: behaviour log-probs = current - d per token (d in {0.1, 0.5, 1.0} by position), so the
    #    token ratio is exp(d), truncated at 2.0 -> weights exp(0.1), exp(0.5), 2.0.
    old = batch.tensors["old_log_probs"]
    shifts = torch.tensor([0.1, 0.5, 1.0])[torch.arange(old.shape[1]) % 3].expand_as(old)
    table = pq.read_table(dump)
    shifted = [(old[i, : int(n)] - shifts[i, : int(n)]).tolist() for i, n in enumerate(batch.response_lengths)]
    table = table.set_column(table.schema.names.index("rollout_log_probs"), "rollout_log_probs",
                             pa.array(shifted, pa.list_(pa.float32())))
    # stored rewards on rows 0 and 2 (values the rule reward never gives), null on rows 1 and 3: scored
    table = table.set_column(table.schema.names.index("reward"), "reward",
                             pa.array([0.7, None, -0.3, None], pa.float64()))
    pq.write_table(table, tmp_path / "shifted.parquet")
    cfg = load_config("tiny_cpu", _offline(data_dir, tmp_path / "b", tmp_path / "shifted.parquet", **rc))
    batch2, m2 = _phases(cfg)
    expected = torch.exp(shifts).clamp(max=2.0) * mask
    assert torch.allclose(batch2.tensors["rollout_is_weights"], expected, atol=1e-4)
    assert m2["rollout_corr/rollout_is_mean"] == pytest.approx(float(expected[mask].mean()), abs=1e-4)
    # token_k1 with threshold 2: ratios outside [0.5, 2] are rejected -> the d=1.0 tokens (ratio e)
    assert m2["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        float((shifts[mask] == 1.0).float().mean()), abs=1e-6)
    scored = batch.tensors["sequence_scores"]  # part 1: the dump's rewards, = the rule reward of the same text
    assert batch2.tensors["sequence_scores"].tolist() == pytest.approx([0.7, float(scored[1]), -0.3, float(scored[3])])
    assert m2["reward/stored_fraction"] == 0.5 and m2["reward/score/min"] == pytest.approx(-0.3)

    # 3. The dump trains offline, unchanged, through the CLI (one step, validation online).
    out = tmp_path / "c"
    subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train",
                    *_offline(data_dir, out, dump, **rc, **{"trainer.test_freq": 1})],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, timeout=900)
    import json

    rec = json.loads((out / "logs" / "metrics.jsonl").read_text().splitlines()[-1])
    assert math.isfinite(rec["actor/pg_loss"]) and "val/test_score/openai/gsm8k" in rec
    assert rec["timing/gen"] < 1.0  # no generation


# ----------------------------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def tokenizer(data_dir):
    from megatron_ppo.data.tokenizer import gsm8k_tokenizer

    return gsm8k_tokenizer(data_dir, vocab_size=300)


def _write(tmp_path, name, response_ids, logp, prompt_ids=(1, 2, 3), metadata=None):
    table = pa.table({"data_source": ["openai/gsm8k"] * 2,
                      "prompt": [[{"role": "user", "content": "What is 1 + 2?"}]] * 2,
                      "prompt_ids": pa.array([list(prompt_ids)] * 2, pa.list_(pa.int32())),
                      "response_ids": pa.array([[5, 6], response_ids], pa.list_(pa.int32())),
                      "rollout_log_probs": pa.array([[-0.1, -0.2], logp], pa.list_(pa.float32()))})
    if metadata:
        table = table.replace_schema_metadata(metadata)
    path = tmp_path / name
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize("response_ids, logp, prompt_ids, metadata, message", [
    ([5, 6], [-0.1, float("nan")], (1, 2, 3), None, "row 1: 'rollout_log_probs'[1] = nan"),
    ([5, 6], [-0.1, 0.3], (1, 2, 3), None, "row 1: 'rollout_log_probs'[1] = 0.3"),
    ([5, 6, 7], [-0.1, -0.2], (1, 2, 3), None, "row 1: 'response_ids' has 3 tokens but 'rollout_log_probs' has 2"),
    ([5, 300], [-0.1, -0.2], (1, 2, 3), None, "row 1: column 'response_ids' holds token id 300, outside the actor's "
                                              "vocabulary [0, 300)"),
    ([5, 6], [-0.1, -0.2], (1, 4096), None, "row 0: column 'prompt_ids' holds token id 4096"),
    ([5, 6], [-0.1, -0.2], (1, 2), {b"megatron_ppo.tokenizer_sha256": b"0123456789abcdef"},
     "row 0: written with tokenizer 0123456789ab"),
    ([5, 6] * 5, [-0.1] * 10, (1, 2), None, "row 1: column 'response_ids' has 10 tokens > data.max_response_length=8"),
])
def test_bad_trajectory_files_are_refused_naming_the_row(tokenizer, tmp_path, response_ids, logp, prompt_ids,
                                                         metadata, message):
    from megatron_ppo.data.trajectory import TrajectoryError
    from megatron_ppo.rollout.offline import OfflineTrajectories

    path = _write(tmp_path, "bad.parquet", response_ids, logp, prompt_ids, metadata)
    with pytest.raises(TrajectoryError) as err:
        OfflineTrajectories([path], tokenizer, len(tokenizer), 64, 8)
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


def test_good_file_with_the_writers_tokenizer_is_accepted(tokenizer, tmp_path):
    from megatron_ppo.data.trajectory import TrajectoryError, TrajectoryWriter
    from megatron_ppo.rollout.offline import OfflineTrajectories, rollout_batch

    writer = TrajectoryWriter(tmp_path / "dump", policy_name="p", temperature=1.0, tokenizer=tokenizer)
    path = writer.append(3, {"data_source": ["openai/gsm8k"], "prompt": [[{"role": "user", "content": "hi"}]],
                             "prompt_ids": [[1, 2]], "response_ids": [[7, 8, 9]],
                             "rollout_log_probs": [[-0.5, -0.25, -1.0]], "reward": [None]})
    data = OfflineTrajectories([path], tokenizer, len(tokenizer), 64, 8)
    batch = rollout_batch(data.rows([0]), data.pad_token_id, step=1)
    assert batch.responses.tolist() == [[7, 8, 9]] and batch.meta["stored_reward"] == [None]
    assert batch.tensors["rollout_log_probs"].tolist() == [[-0.5, -0.25, -1.0]]
    assert data.dataset[0]["source"] == f"{path}: row 0"
    with pytest.raises(TrajectoryError) as err:  # sampled at 1.0: scoring it at 0.7 would skew every IS ratio
        OfflineTrajectories([path], tokenizer, len(tokenizer), 64, 8, temperature=0.7)
    assert f"{path}: row 0: behaviour_policy.temperature is 1, rollout.temperature is 0.7" in str(err.value)
    assert "set rollout.temperature=1" in str(err.value)
    assert len(OfflineTrajectories([path], tokenizer, len(tokenizer), 64, 8, temperature=1.0)) == 1


@pytest.mark.slow
def test_offline_at_the_default_ray_layout(dump, data_dir, tmp_path):
    """The dump trains offline at tiny_cpu's own layout (Ray: actor/ref TP2, critic DP2): two steps, IS weights
    applied, validation online."""
    import json

    out = tmp_path / "ray"
    subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
                    "rollout.mode=offline", f"rollout.trajectory_files=[{dump}]", "data.train_files=[]",
                    "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
                    "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=1",
                    "algorithm.rollout_correction.rollout_is=token", "trainer.total_training_steps=2",
                    "trainer.test_freq=2", "trainer.val_before_train=false", "data.val_max_samples=4",
                    f"data.preprocess.output_dir={data_dir}", f"data.val_files=[{data_dir}/test.parquet]",
                    f"trainer.log_dir={out}"], check=True, cwd=REPO, stdout=subprocess.DEVNULL, timeout=900)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and "rollout_corr/rollout_is_mean" in r for r in recs)
    assert "val/test_score/openai/gsm8k" in recs[-1]
    assert json.loads((out / "layout.json").read_text())["roles"]["actor"]["tp"] == 2


def test_offline_refuses_more_than_one_response_per_row(data_dir, tmp_path):
    """A config-only check (config/checks.py): refused at load, before anything is built."""
    with pytest.raises(ValueError, match="rollout.n: must be 1 with rollout.mode=offline .*got 2"):
        load_config("tiny_cpu", _offline(data_dir, tmp_path, tmp_path / "t.parquet", **{"rollout.n": 2}))


@pytest.mark.slow
def test_sequence_level_is_weights_and_metrics_equal_a_hand_computation(dump, data_dir, tmp_path):
    """rollout_is=sequence on a crafted shift: row i's behaviour log-probs are the current policy's minus t_i / n_i
    on each of its n_i tokens, so its log-ratio sums to t_i and its weight is min(exp(t_i), 2) on every token.
    t = (0.3, -1.0, 1.5, 0.0): one row inside [0.5, 2], one below 0.5, one truncated, one exactly on-policy."""
    rc = {"algorithm.rollout_correction.rollout_is": "sequence",
          "algorithm.rollout_correction.rollout_is_threshold": 2.0}
    batch, _ = _phases(load_config("tiny_cpu", _offline(data_dir, tmp_path / "a", dump, **rc)))
    old, n = batch.tensors["old_log_probs"].double(), batch.response_lengths.double()
    assert torch.all(n > 0) and batch.size == 4
    totals = torch.tensor([0.3, -1.0, 1.5, 0.0], dtype=torch.float64)
    d = (totals / n).unsqueeze(1)  # per-token log-ratio of each row
    table = pq.read_table(dump)
    behaviour = [(old[i, : int(k)] - d[i]).tolist() for i, k in enumerate(n)]
    table = table.set_column(table.schema.names.index("rollout_log_probs"), "rollout_log_probs",
                             pa.array(behaviour, pa.list_(pa.float32())))
    pq.write_table(table, tmp_path / "shifted.parquet")
    batch2, m = _phases(load_config("tiny_cpu", _offline(data_dir, tmp_path / "b", tmp_path / "shifted.parquet", **rc)))
    mask = batch2.response_mask.bool()

    # by hand, from t and n only
    seq_w = [min(math.exp(t), 2.0) for t in totals.tolist()]
    lens = [int(k) for k in n.tolist()]
    tok_w = np.repeat(seq_w, lens)  # every token of a row carries the row's weight
    tok_d = np.repeat((totals / n).tolist(), lens)
    expected = torch.tensor(seq_w).unsqueeze(1) * mask
    assert torch.allclose(batch2.tensors["rollout_is_weights"].double(), expected.double(), atol=1e-4)
    hand = {
        "rollout_is_mean": tok_w.mean(),
        "rollout_is_max": math.exp(1.5),  # the largest raw sequence ratio, before truncation (as verl)
        "rollout_is_min": math.exp(-1.0),
        "rollout_is_ratio_fraction_high": 1 / 4,  # sequences with exp(t) > 2
        "rollout_is_ratio_fraction_low": 1 / 4,  # sequences with exp(t) < 1 / 2
        "rollout_is_std": tok_w.std(),
        "rollout_is_eff_sample_size": 1.0 / np.mean((tok_w / tok_w.mean()) ** 2),
        "rollout_is_seq_mean": np.mean(seq_w),
        "rollout_is_seq_std": np.std(seq_w, ddof=1),
        "rollout_is_seq_max": max(seq_w),
        "rollout_is_seq_min": min(seq_w),
        "rollout_is_seq_max_deviation": max(abs(w - 1) for w in seq_w),
        "rollout_is_seq_fraction_high": 1 / 4,
        "rollout_is_seq_fraction_low": 1 / 4,
        "kl": float(-(tok_d.mean())),  # KL(rollout || train), k1 = mean of -log_ratio over tokens
        "k3_kl": float(np.mean(np.exp(tok_d) - tok_d - 1)),
        "log_ppl_diff": float(np.mean(-(totals / n).numpy())),  # per row: rollout mean log-prob - training's
        "log_ppl_abs_diff": float(np.mean(np.abs((totals / n).numpy()))),
        "ppl_ratio": float(np.mean(np.exp(-(totals / n).numpy()))),
        "chi2_token": float(np.mean(np.exp(2 * tok_d)) - 1),
        "chi2_seq": float(np.mean(np.exp(2 * totals.numpy())) - 1),
        "training_log_ppl": float(np.mean([-old[i, :k].mean().item() for i, k in enumerate(lens)])),
    }
    for key, value in hand.items():
        assert m[f"rollout_corr/{key}"] == pytest.approx(value, abs=2e-4), key
    assert "rollout_corr/rollout_rs_masked_fraction" not in m  # no rejection configured
