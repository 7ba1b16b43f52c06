"""The in-process PPO driver end to end on real megatron-core models (CPU, gloo), real GSM8K parquet and the
built BPE tokenizer: what each phase produces, the target-KL guard, trajectory dumps, and learning."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ppo.config import load_config

REPO = Path(__file__).resolve().parents[2]
VOWEL_REWARD = Path(__file__).with_name("vowel_reward.py")
STEPS = 20


def _overrides(data_dir: Path, tmp: Path, **extra) -> list[str]:
    base = {
        "data.preprocess.output_dir": str(data_dir),
        "data.train_files": f"[{data_dir}/train.parquet]",
        "data.val_files": f"[{data_dir}/test.parquet]",
        "data.train_batch_size": 4, "data.train_max_samples": 16, "data.val_max_samples": 4,
        "data.max_response_length": 8,
        "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2,
        "critic.ppo_mini_batch_size": 2, "critic.ppo_micro_batch_size_per_gpu": 2,
        "trainer.total_training_steps": 1, "trainer.test_freq": -1, "trainer.logger": "[jsonl]",
        "trainer.log_dir": str(tmp / "logs"),
        # one in-process rank per role (LocalWorkerGroup); tests/integration/test_ppo_ray.py runs the Ray layouts
        "cluster.launcher": "local", "cluster.n_gpus_per_node": 1,
        "cluster.actor.tensor_model_parallel_size": 1, "cluster.ref.tensor_model_parallel_size": 1,
        # the settings these tests were written for (tiny_cpu.yaml now has the learnable default's)
        "trainer.val_before_train": "false", "actor.ppo_epochs": 1, "critic.ppo_epochs": 1,
        "actor.optim.lr": 1e-4, "critic.optim.lr": 1e-4, "reward.format_score": 0.0,
        "data.preprocess.tokenizer_vocab_size": 2048,  # one padded vocabulary at TP1 and TP2 (test_ppo_ray)
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_data")


def _params(group):
    """The weights of a role's in-process rank (a LocalWorkerGroup's worker)."""
    return {k: v.detach().clone() for k, v in group.worker.model.named_parameters()}


def _changed(before, group):
    return [k for k, v in group.worker.model.named_parameters() if not torch.equal(before[k], v.detach())]


def test_one_ppo_step_end_to_end(data_dir, tmp_path):
    from megatron_ppo import parallel
    from megatron_ppo.data.trajectory import TrajectoryDataset
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    # 2 mini-batches per step: the lr schedule must still advance once per training step (verl's rule)
    # rollout.stop_pattern: a response ends at the token that completes its first vowel (the random tiny model
    # writes one in most of its 8 tokens), checked on the dumped trajectories below
    overrides = _overrides(data_dir, tmp_path, **{"rollout.dump_dir": str(tmp_path / "dump"),
                                                  "actor.optim.lr_warmup_steps": 4, "actor.optim.lr_warmup_init": 1e-5,
                                                  "rollout.stop_pattern": "[aeiou]", "rollout.n": 2})
    cfg = load_config("tiny_cpu", overrides)
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        actor0, critic0, ref0 = _params(parts.actor), _params(parts.critic), _params(parts.ref)
        assert all(torch.equal(actor0[k], ref0[k]) for k in actor0)  # the reference starts as the actor
        history = PPOTrainer(cfg, parts).fit(1)
        parts.tracker.close()
        assert _changed(actor0, parts.actor) and _changed(critic0, parts.critic)
        assert not _changed(ref0, parts.ref)
        lr = cfg.actor.optim.lr
        assert parts.actor.worker.optimizer.param_groups[0]["lr"] == pytest.approx(1e-5 + (lr - 1e-5) / 4)
    finally:
        parallel.destroy()
        disable_cpu_platform()

    metrics = history[0]
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/kl_loss", "actor/grad_norm",
                "critic/vf_loss", "critic/vf_explained_var", "reward/score/mean", "timing/gen",
                "timing/update_actor", "timing/sync_weights", "perf/tokens_per_s", "response_length/mean"):
        assert key in metrics, key
    # Recomputed old log-probs (packed, teacher-forced) equal the sampler's log-probs of the same tokens.
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-4
    assert metrics["actor/updates_skipped"] == 0
    assert metrics["actor/lr"] == pytest.approx(1e-5)  # the lr step 1 used: the start of warmup
    logged = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 1 and logged[-1]["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"])
    # The step's rollouts were dumped as trajectory parquet that the offline dataset reads back.
    dumped = TrajectoryDataset(sorted((tmp_path / "dump").glob("*.parquet")))
    assert len(dumped) == cfg.data.train_batch_size * cfg.rollout.n
    # every dumped response ends at its first vowel (or has none): the stop reached what was scored and trained
    text = lambda ids: parts.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    stopped = [re.search("[aeiou]", text(item["response_ids"])) is not None for item in dumped]
    for item, stop in zip(dumped, stopped):
        ids = item["response_ids"]
        assert not stop or re.search("[aeiou]", text(ids[:-1])) is None, text(ids)
        assert len(item["rollout_log_probs"]) == len(ids)
    assert any(stopped) and metrics["response_length/stop_ratio"] == pytest.approx(sum(stopped) / len(stopped))


@pytest.mark.slow
def test_target_kl_guard_skips_the_update_after_a_large_step(data_dir, tmp_path):
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    # Epoch 1 runs on the rollout policy (KL ~ 0 < target); the big lr then moves the policy far, so the guard
    # (on the k3 estimate of KL(old || current), actor/ppo_kl_k3) must skip epoch 2's mini-batch.
    overrides = _overrides(data_dir, tmp_path, **{
        "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size_per_gpu": 4, "actor.ppo_epochs": 2,
        "actor.optim.lr": 0.05, "algorithm.kl_guard.enable": "true", "algorithm.kl_guard.target_kl": 1e-4})
    cfg = load_config("tiny_cpu", overrides)
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        metrics = PPOTrainer(cfg, parts).fit(1)[0]
        parts.tracker.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    assert metrics["actor/kl_guard_skips"] == 1
    assert metrics["actor/updates_skipped"] == 1
    assert metrics["actor/ppo_kl_k3"] > 0


@pytest.mark.parametrize("override, name", [
    ("data.reward_fn_key=src", "data.reward_fn_key (rewards are chosen by data_source)"),
    ("actor.optim.optimizer=sgd", "actor.optim.optimizer=sgd (Adam only)"),
    ("critic.optim.optimizer=sgd", "critic.optim.optimizer=sgd (Adam only)"),
    ("actor.entropy_from_logits_chunk_size=512",
     "actor.entropy_from_logits_chunk_size (log-probs and entropy use models.logprobs.DEFAULT_CHUNK)"),
    ("critic.model.tokenizer_path=other/",
     "critic.model.tokenizer_path / ref.model.tokenizer_path / reward.reward_model.model.tokenizer_path (all roles "
     "use the actor's tokenizer)"),
    ("reward.reward_model.model.tokenizer_path=other/",
     "critic.model.tokenizer_path / ref.model.tokenizer_path / reward.reward_model.model.tokenizer_path (all roles "
     "use the actor's tokenizer)"),
    ("trainer.log_val_generations=4", "trainer.log_val_generations > 0"),
])
def test_train_refuses_what_it_would_otherwise_ignore(override, name):
    from megatron_ppo.errors import UsageError
    from megatron_ppo.trainer.entry import main

    with pytest.raises(UsageError, match=re.escape(repr(name))):
        main(override.split())


def test_train_refuses_cluster_device_cuda_without_cuda(monkeypatch):
    """Checked where training starts (a config for a GPU cluster still loads on a CPU machine)."""
    from megatron_ppo.errors import UsageError
    from megatron_ppo.trainer.entry import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine, as a CPU-only one
    assert load_config("tiny_cpu", ["cluster.device=cuda"]).cluster.device == "cuda"
    with pytest.raises(UsageError, match=re.escape("cluster.device=cuda, but torch.cuda.is_available() is false")):
        main(["cluster.device=cuda"])


def test_cluster_device_cpu_on_a_cuda_machine_is_a_warning(caplog):
    from megatron_ppo.trainer.preflight import check_device

    with caplog.at_level("WARNING", logger="megatron_ppo.trainer.entry"):
        check_device(load_config("tiny_cpu"), cuda_available=True)
        check_device(load_config("tiny_cpu", ["cluster.device=auto"]), cuda_available=True)
    assert caplog.text.count("cluster.device=cpu, but this machine has CUDA") == 1


@pytest.mark.slow
def test_ppo_learns_a_learnable_reward(data_dir, tmp_path):
    """Through the CLI: GAE PPO on a reward a tiny random model can move (vowel share of the response).
    Measured: 0.35 -> 0.63 mean reward in 16 steps."""
    overrides = _overrides(data_dir, tmp_path, **{
        "trainer.total_training_steps": STEPS, "data.train_batch_size": 16, "data.train_max_samples": 512,
        "actor.ppo_mini_batch_size": 8, "actor.ppo_micro_batch_size_per_gpu": 8, "actor.ppo_epochs": 2,
        "critic.ppo_mini_batch_size": 8, "critic.ppo_micro_batch_size_per_gpu": 8, "critic.ppo_epochs": 2,
        "actor.optim.lr": 1e-2, "critic.optim.lr": 1e-2,
        "reward.custom_reward_function.path": str(VOWEL_REWARD)})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *overrides], check=True, cwd=REPO, env=env,
                   stdout=subprocess.DEVNULL, timeout=1500)
    scores = [json.loads(line)["reward/score/mean"]
              for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(scores) == STEPS
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1, scores


@pytest.mark.slow
def test_actor_and_critic_start_from_an_hf_checkpoint(data_dir, tmp_path):
    """actor.model.path = an HF Llama dir: the actor's logits equal HF's, the critic gets the same backbone with a
    fresh value head, the reference equals the actor, and a PPO step runs."""
    transformers = pytest.importorskip("transformers")
    from megatron_ppo import parallel
    from megatron_ppo.convert.verify import megatron_logits
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False, rms_norm_eps=1e-6)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    overrides = _overrides(data_dir, tmp_path, **{"actor.model.path": str(tmp_path / "hf"), "actor.model.arch": "null",
                                                  "trainer.default_local_dir": str(tmp_path / "ckpt")})
    cfg = load_config("tiny_cpu", overrides)
    tokens = torch.randint(0, 2048, (2, 12))
    with torch.no_grad():
        expected = hf(tokens).logits.float()
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        got = megatron_logits(parts.actor.worker.model, tokens, 2048)
        assert (got - expected).abs().max().item() <= 1e-4
        actor = dict(parts.actor.worker.model.named_parameters())
        critic = dict(parts.critic.worker.model.named_parameters())
        backbone = [k for k in actor if k.startswith("decoder.")]
        assert backbone and all(torch.equal(actor[k], critic[k]) for k in backbone)
        assert tuple(critic["output_layer.weight"].shape)[0] == 1  # the value head, not the LM head
        history = PPOTrainer(cfg, parts).fit(1)
        parts.tracker.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    assert history[0]["rollout/logprob_abs_diff_max"] < 1e-4
    assert not (tmp_path / "ckpt" / "hf_import").exists()  # nothing converted: each rank read its own HF slices


def test_grpo_step_groups_the_n_responses_of_each_prompt(data_dir, tmp_path):
    """adv_estimator=grpo: no critic; each prompt's rollout.n responses form one group (uid per prompt and step),
    so every group's advantages are centred on the group's mean reward."""
    from megatron_ppo import parallel
    from megatron_ppo.algo.advantages import masked_mean
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    overrides = _overrides(data_dir, tmp_path, **{
        "algorithm.adv_estimator": "grpo", "rollout.n": 4, "actor.ppo_mini_batch_size": 4,
        "reward.custom_reward_function.path": str(VOWEL_REWARD)})
    cfg = load_config("tiny_cpu", overrides)
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        assert parts.critic is None
        trainer = PPOTrainer(cfg, parts)
        trainer.step = 1
        batch = trainer.rollout(parts.sampler.next_batch())
        metrics: dict = {}
        trainer.score(batch, metrics)
        trainer.evaluate(batch, metrics)
        trainer.compute_advantages(batch, metrics)
        trainer.update_actor(batch, metrics)
        parts.tracker.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    assert batch.meta["uid"] == [f"1-{i}" for i in range(4) for _ in range(4)]
    scores = batch.tensors["sequence_scores"].reshape(4, 4)
    assert float(scores.std(dim=1).max()) > 0  # the groups have signal
    seq_adv = masked_mean(batch.tensors["advantages"], batch.response_mask, axis=-1).reshape(4, 4)
    assert torch.allclose(seq_adv.mean(dim=1), torch.zeros(4), atol=1e-5)
    assert metrics["actor/updates_skipped"] == 0 and "actor/pg_loss" in metrics


# ---------------------------------------------------------------------------------------------- non-finite steps

def _reward_file(tmp: Path, expression: str) -> Path:
    path = tmp / "reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    f"    return {expression}\n")
    return path


def _run_until_error(cfg, steps):
    """Build the parts, snapshot every role's weights, run fit(steps); return (parts, snapshots, error, records)."""
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import NonFiniteTrainingError, PPOTrainer

    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        before = {role: _params(getattr(parts, role)) for role in ("actor", "critic") if getattr(parts, role)}
        with pytest.raises(NonFiniteTrainingError) as info:
            PPOTrainer(cfg, parts).fit(steps)
        parts.tracker.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    records = [json.loads(line) for line in (Path(cfg.trainer.log_dir) / "metrics.jsonl").read_text().splitlines()]
    return parts, before, str(info.value), records


def test_a_huge_finite_reward_skips_every_critic_update_and_stops_the_run(data_dir, tmp_path, caplog):
    """The issue's run: a reward of 1e30 (finite, so the reward check passes) makes the critic's value loss inf.
    No such update may reach the critic's weights (bit-identical), each is counted, and after
    trainer.max_consecutive_skips steps the run stops with an error naming the role, the step and the values."""
    overrides = _overrides(data_dir, tmp_path, **{
        "reward.custom_reward_function.path": str(_reward_file(tmp_path, "1e30")),
        "trainer.total_training_steps": 3, "trainer.max_consecutive_skips": 2})
    with caplog.at_level("WARNING", logger="megatron_ppo.rewards.batch"):
        parts, before, error, records = _run_until_error(load_config("tiny_cpu", overrides), 3)
    assert not _changed(before["critic"], parts.critic)
    assert _changed(before["actor"], parts.actor)  # whitened advantages stay finite: the actor still trains
    assert len(records) == 2  # stopped after step 2 of 3, with both steps' metrics logged
    for m in records:
        assert float(m["critic/vf_loss"]) == float("inf")  # the jsonl writes non-finite values as strings
        assert m["critic/updates_skipped"] == m["critic/updates_skipped_nonfinite"] == 2  # both mini-batches
        assert m["actor/updates_skipped"] == 0 and m["actor/grad_norm"] > 0
        assert m["reward/score/num_large"] == 4
    for text in ("critic: 2 consecutive steps (the last: step 2)", "non-finite", "loss [inf, inf]",
                 "trainer.max_consecutive_skips=2", "[1e+30, 1e+30]"):
        assert text in error, error
    assert "observed range [1e+30, 1e+30]" in caplog.text


def test_a_nonfinite_actor_gradient_norm_is_skipped_and_the_actor_stays_bit_identical(data_dir, tmp_path):
    """A real path to a non-finite actor update, no test hook: GRPO without std normalisation passes reward
    differences of ~1e31 through as advantages; the policy-gradient norm then overflows fp32 (inf)."""
    overrides = _overrides(data_dir, tmp_path, **{
        "reward.custom_reward_function.path": str(_reward_file(tmp_path, "1e30 * len(solution_str)")),
        "algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": "false", "rollout.n": 2,
        "trainer.total_training_steps": 3, "trainer.max_consecutive_skips": 1})
    parts, before, error, records = _run_until_error(load_config("tiny_cpu", overrides), 3)
    assert parts.critic is None and not _changed(before["actor"], parts.actor)
    assert len(records) == 1
    assert records[0]["actor/updates_skipped_nonfinite"] == records[0]["actor/updates_skipped"] == 2
    assert records[0]["actor/grad_norm"] == "nan"  # no update was applied (the jsonl writes nan as a string)
    assert "actor: 1 consecutive steps (the last: step 1)" in error and "grad_norm [inf" in error, error


def test_max_consecutive_skips_counts_only_consecutive_steps(data_dir, tmp_path):
    """-1: never stop; the skipped updates are still skipped and counted every step."""
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    overrides = _overrides(data_dir, tmp_path, **{
        "reward.custom_reward_function.path": str(_reward_file(tmp_path, "1e30")),
        "trainer.total_training_steps": 2, "trainer.max_consecutive_skips": -1})
    cfg = load_config("tiny_cpu", overrides)
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        critic0 = _params(parts.critic)
        history = PPOTrainer(cfg, parts).fit(2)
        parts.tracker.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    assert [m["critic/updates_skipped_nonfinite"] for m in history] == [2, 2]
    assert not _changed(critic0, parts.critic)


def test_token_budget_micro_batches_give_the_fixed_size_update(data_dir, tmp_path):
    """use_dynamic_bsz (micro-batches by ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu) splits the
    same mini-batch differently but, the losses being normalised by the whole mini-batch, the step is the same."""
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    common = {"actor.ppo_mini_batch_size": 4, "critic.ppo_mini_batch_size": 4,
              "actor.ppo_micro_batch_size_per_gpu": 1, "critic.ppo_micro_batch_size_per_gpu": 1}
    dynamic = {"actor.use_dynamic_bsz": "true", "critic.use_dynamic_bsz": "true",
               "rollout.log_prob_use_dynamic_bsz": "true", "ref.log_prob_use_dynamic_bsz": "true",
               **{f"{k}": 600 for k in ("actor.ppo_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
                                        "rollout.log_prob_max_token_len_per_gpu", "ref.log_prob_max_token_len_per_gpu")}}
    runs = {}
    for name, extra in (("fixed", {}), ("dynamic", dynamic)):
        cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path / name, **common, **extra))
        parts = build_components(cfg)
        try:
            if name == "dynamic":  # the budget really packs several rows per micro-batch
                from megatron_ppo.data.batch import RolloutBatch, micro_batches_by_tokens

                b = RolloutBatch([torch.ones(100, dtype=torch.long)] * 4, torch.ones(4, 8, dtype=torch.long),
                                 torch.ones(4, 8))
                assert len(micro_batches_by_tokens(b, [0, 1, 2, 3], 600)) == 1
            runs[name] = PPOTrainer(cfg, parts).fit(1)[0]
        finally:
            parts.close()
            disable_cpu_platform()
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
                "rollout/logprob_abs_diff_max", "actor/ppo_kl_k3"):
        assert runs["dynamic"][key] == pytest.approx(runs["fixed"][key], rel=1e-4, abs=1e-6), key


def test_a_model_vocabulary_larger_than_the_tokenizers_is_scored_over_the_whole_vocabulary(data_dir, tmp_path):
    """An arch with vocab_size 4096 over the 2048-token tokenizer (as an HF model with padded embeddings): the
    sampler draws from all 4096 ids, so the log-probs must be over the model's vocabulary, not the tokenizer's."""
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    arch = ("{num_layers: 2, hidden_size: 64, ffn_hidden_size: 256, num_attention_heads: 4, num_query_groups: 2, "
            "max_position_embeddings: 512, vocab_size: 4096}")
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{"actor.model.arch": arch}))
    parts = build_components(cfg)
    try:
        trainer = PPOTrainer(cfg, parts)
        metrics = trainer.fit(1)[0]
    finally:
        parts.close()
        disable_cpu_platform()
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-4 and metrics["actor/updates_skipped"] == 0
