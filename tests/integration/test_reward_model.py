"""Reward models: an HF *ForSequenceClassification checkpoint scores sequences exactly as transformers does.

Independent reference: transformers' own forward (``AutoModelForSequenceClassification``, fp32) on each unpadded
sequence, whose logit is the score at the last token. Checked at three levels: the converter (HF -> Megatron ->
HF, bit-exact round trip), the RewardModelWorker (in-process, and on Ray at TP2 and DP2), and the trainer (the
reward a step used, read back from its trajectory dump, equals transformers' score of the dumped ids).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from megatron_ppo.config import load_config
from megatron_ppo.convert.mapping import ConversionError, arch_from_hf_config
from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf
from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.testing.conversion import compare_hf_checkpoints
from megatron_ppo.testing.tiny_hf import REWARD_KINDS, TINY_VOCAB, make_tiny_hf

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_ppo import _overrides, data_dir  # noqa: E402,F401  (helpers and fixture reused)

TOL = 1e-4
WORKER = "megatron_ppo.workers.reward_model:RewardModelWorker"


def hf_scores(hf_dir: str, sequences: list[list[int]]) -> list[float]:
    """transformers' score of each sequence, one unpadded sequence at a time (its last token is the one scored)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([s])).logits[0, 0]) for s in sequences]


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_rm")
    return {kind: make_tiny_hf(kind, str(root / kind), seed=3) for kind in REWARD_KINDS}


def rollout(prompt_lengths, response_lengths, width: int = 6, seed: int = 0) -> RolloutBatch:
    """Rows of random tokens (never 0: HF's pad id) with the given prompt and response lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, TINY_VOCAB, (n,), generator=g) for n in prompt_lengths]
    responses = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width)
    for i, n in enumerate(response_lengths):
        responses[i, :n] = torch.randint(1, TINY_VOCAB, (n,), generator=g)
        mask[i, :n] = 1
    return RolloutBatch(prompts, responses, mask, {})


def sequences(batch: RolloutBatch) -> list[list[int]]:
    return [torch.cat([batch.prompt_ids[i], batch.responses[i, :int(batch.response_lengths[i])]]).tolist()
            for i in range(batch.size)]


def rm_config(hf_dir: str, tmp_path: Path, *extra: str):
    return load_config("tiny_cpu", ["reward.reward_model.enable=true", f"reward.reward_model.model.path={hf_dir}",
                                    f"trainer.default_local_dir={tmp_path / 'ckpt'}", *extra])


@pytest.mark.parametrize("kind", REWARD_KINDS)
def test_reward_model_checkpoint_converts_both_ways_exactly(kind, reward_models, tmp_path, megatron_single):
    """HF score head -> the Megatron value head ([1, hidden], replicated) -> HF again, every tensor bit-identical;
    the Megatron model built as a reward model loads the checkpoint strictly."""
    from megatron_ppo.convert.verify import load_dist_checkpoint
    from megatron_ppo.models.gpt import build_gpt_model

    hf_dir = reward_models[kind]
    report = hf_to_mcore(hf_dir, str(tmp_path / "mcore"), tp=1, pp=1, quiet=True)
    assert report.ledger["params_in"] + report.ledger["padding_added"] == report.ledger["params_out"]
    model = build_gpt_model(arch_from_hf_config(hf_dir), "reward")
    load_dist_checkpoint(model, str(tmp_path / "mcore"), strict=True)
    from safetensors.torch import load_file

    score = load_file(str(Path(hf_dir) / "model.safetensors"))["score.weight"]
    assert torch.equal(model.output_layer.weight.detach(), score)
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "hf_back"), quiet=True)
    assert compare_hf_checkpoints(hf_dir, str(tmp_path / "hf_back")) == []


@pytest.mark.parametrize("kind", REWARD_KINDS)
@pytest.mark.parametrize("micro", [None, 2])
def test_reward_model_worker_scores_equal_transformers(kind, micro, reward_models, tmp_path):
    """Rows of different prompt and response lengths (one fills the response width, one is empty: scores 0),
    micro-batched by sequence count or by token budget: the score of each is transformers' logit."""
    from megatron_ppo.distributed import LocalWorkerGroup
    from megatron_ppo.parallel.platform import disable_cpu_platform

    hf_dir = reward_models[kind]
    cfg = rm_config(hf_dir, tmp_path, f"reward.reward_model.micro_batch_size_per_gpu={micro or 'null'}",
                    "rollout.log_prob_max_token_len_per_gpu=24")
    batch = rollout([5, 9, 3, 7, 4], [6, 2, 4, 0, 1])
    group = LocalWorkerGroup("reward", WORKER, {"cfg": cfg, "vocab_size": TINY_VOCAB})
    try:
        got = group.call_dp("compute_scores", [batch.select(keys=(), meta=False)])[0]["scores"]
    finally:
        group.shutdown()
        disable_cpu_platform()
    want = hf_scores(hf_dir, sequences(batch))
    assert got.dtype == torch.float32 and got.shape == (5,)
    assert float(got[3]) == 0.0  # the empty response
    for i in (0, 1, 2, 4):
        assert abs(float(got[i]) - want[i]) <= TOL, (i, float(got[i]), want[i])
    assert len({round(float(s), 4) for s in got}) == 5  # the rows really differ


def test_a_causal_lm_is_not_a_reward_model_and_a_reward_model_is_not_a_policy(reward_models, tmp_path):
    from megatron_ppo.trainer.preflight import PreflightError, check_model_paths

    lm = make_tiny_hf("llama", str(tmp_path / "lm"))
    with pytest.raises(PreflightError, match=r"reward\.reward_model\.model\.path=.*not a reward model"):
        check_model_paths(rm_config(lm, tmp_path))
    with pytest.raises(PreflightError, match=r"actor\.model\.path=.*is a reward model"):
        check_model_paths(load_config("tiny_cpu", [f"actor.model.path={reward_models['llama_rm']}",
                                                   "actor.model.arch=null"]))
    check_model_paths(rm_config(reward_models["qwen2_rm"], tmp_path))  # the right kind passes

    from megatron_ppo.distributed import LocalWorkerGroup, WorkerGroupError
    from megatron_ppo.parallel.platform import disable_cpu_platform

    try:  # the worker refuses it too (a run that skips preflight)
        with pytest.raises(WorkerGroupError, match="is a causal LM, not a reward model"):
            LocalWorkerGroup("reward", WORKER, {"cfg": rm_config(lm, tmp_path), "vocab_size": TINY_VOCAB})
    finally:
        disable_cpu_platform()


def test_a_classifier_with_two_labels_is_refused(reward_models, tmp_path):
    config = json.loads((Path(reward_models["llama_rm"]) / "config.json").read_text())
    config["id2label"], config["num_labels"] = {"0": "a", "1": "b"}, 2
    with pytest.raises(ConversionError, match="num_labels=2: a reward model has one score per sequence"):
        arch_from_hf_config(config)


def test_a_reward_model_with_another_tokenizer_is_refused(data_dir, tmp_path):
    """The reward model reads the actor's token ids as they are: its own, different tokenizer is an error."""
    from megatron_ppo.trainer.components import build_components

    rm = make_tiny_hf("llama_rm", str(tmp_path / "rm"), vocab_size=2048)  # WordLevel t0..t2047, not the BPE
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{
        "reward.reward_model.enable": "true", "reward.reward_model.model.path": rm}))
    with pytest.raises(ValueError, match=r"reward\.reward_model\.model\.path=.*tokenizer .* differs from the actor's"):
        build_components(cfg)


def _dumped_rewards_equal_transformers(run_dir: Path, rm_dir: str) -> int:
    rows = pq.read_table(str(run_dir / "dump")).to_pylist()
    assert rows
    want = hf_scores(rm_dir, [r["prompt_ids"] + r["response_ids"] for r in rows])
    for r, w in zip(rows, want):
        if r["response_ids"]:
            assert abs(r["reward"] - w) <= TOL, (r["reward"], w)
        else:
            assert r["reward"] == 0.0
    return len(rows)


def _train_with_reward_model(data_dir, tmp_path, **extra) -> dict:
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    rm = make_tiny_hf("llama_rm", str(tmp_path / "rm"), vocab_size=2048, tokenizer=False, seed=5)
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{
        "reward.reward_model.enable": "true", "reward.reward_model.model.path": rm,
        "rollout.dump_dir": str(tmp_path / "dump"), "trainer.default_local_dir": str(tmp_path / "ckpt"), **extra}))
    parts = build_components(cfg)
    try:
        metrics = PPOTrainer(cfg, parts).fit(1)[0]
    finally:
        parts.close()
        disable_cpu_platform()
    assert _dumped_rewards_equal_transformers(tmp_path, rm) == cfg.data.train_batch_size
    assert metrics["reward/score/mean"] == pytest.approx(metrics["reward/rm_score/mean"])
    return metrics


def test_a_step_is_rewarded_by_the_reward_model(data_dir, tmp_path):
    """In-process: the reward of every row of the step (its trajectory dump) is transformers' score of its ids."""
    metrics = _train_with_reward_model(data_dir, tmp_path)
    assert "actor/pg_loss" in metrics and "critic/vf_loss" in metrics


@pytest.mark.slow  # Ray: 4 roles x 2 ranks on 2 CPU slots, ~40 s
def test_a_step_on_ray_is_rewarded_by_a_tp2_reward_model(data_dir, tmp_path):
    metrics = _train_with_reward_model(data_dir, tmp_path, **{
        "cluster.launcher": "ray", "cluster.n_gpus_per_node": 2, "cluster.actor.tensor_model_parallel_size": 2,
        "cluster.ref.tensor_model_parallel_size": 2, "cluster.reward.tensor_model_parallel_size": 2,
        "critic.ppo_micro_batch_size_per_gpu": 1})  # the critic fills the world: DP2
    assert "actor/pg_loss" in metrics and metrics["timing/dispatch"] > 0


@pytest.mark.slow  # Ray: two reward-model groups (TP2, DP2), ~25 s
def test_reward_model_worker_on_ray_tp2_and_dp2_equals_transformers(reward_models, tmp_path):
    import ray

    from megatron_ppo.distributed import (ClusterSlots, RankLayout, RankResources, RayWorkerGroup, connect_or_start,
                                          create_placement, plan_placement, remove_placement)

    from megatron_ppo.convert.hf_import import convert_for_roles

    hf_dir = reward_models["qwen2_rm"]
    cfg = rm_config(hf_dir, tmp_path)
    convert_for_roles(cfg, ["reward"])  # as build_components does: the HF headers checked before the ranks start
    batch = rollout([5, 9, 3, 7, 4, 6, 2], [6, 2, 4, 3, 1, 5, 6], seed=1)
    want = hf_scores(hf_dir, sequences(batch))
    lengths = [len(s) for s in sequences(batch)]
    cluster = connect_or_start("local", num_cpus=4) if not ray.is_initialized() else None
    layouts = {"tp2": RankLayout(tp=2), "dp2": RankLayout(dp=2)}
    plan = create_placement(plan_placement(layouts, ClusterSlots(1, 2, "CPU"), "colocated", RankResources(1)))
    try:
        for name, layout in layouts.items():
            group = RayWorkerGroup("reward", layout, plan.roles[name], WORKER, {"cfg": cfg, "vocab_size": TINY_VOCAB},
                                   collective_timeout_s=60)
            try:
                got = group.call_rows("compute_scores", batch.select(keys=(), meta=False), lengths)["scores"]
            finally:
                group.shutdown()
            assert [abs(float(g) - w) <= TOL for g, w in zip(got, want)] == [True] * batch.size, (name, got, want)
    finally:
        remove_placement(plan)
        if cluster is not None:
            cluster.shutdown()
