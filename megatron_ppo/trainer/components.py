"""Everything the driver needs, built from the config: data, tokenizer, reward scorer, workers, controllers.

Kept apart from the loop so that ppo.py reads as a recipe and the Ray driver can build the same parts per rank.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ppo.algo.kl_control import TargetKLGuard, build_kl_controller
from megatron_ppo.data.gsm8k import SPLITS as GSM8K_SPLITS
from megatron_ppo.data.gsm8k import default_gsm8k_dir
from megatron_ppo.data.parquet_io import expand_parquet_paths
from megatron_ppo.data.preprocess import preprocess_gsm8k
from megatron_ppo.data.prompt_dataset import PromptDataset, overlong_policy_from_verl
from megatron_ppo.data.sampler import StatefulSampler
from megatron_ppo.data.tokenizer import gsm8k_tokenizer_dir, load_tokenizer
from megatron_ppo.data.trajectory import TrajectoryWriter
from megatron_ppo.models.arch import ModelArch
from megatron_ppo.rewards.batch import RewardScorer
from megatron_ppo.trainer.tracking import Tracker
from megatron_ppo.workers.megatron_worker import MegatronWorker

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True)
class Components:
    total_steps: int
    tokenizer: object
    eos_token_ids: list[int]
    train_dataset: PromptDataset
    val_dataset: PromptDataset | None
    sampler: StatefulSampler
    scorer: RewardScorer
    actor: MegatronWorker
    ref: MegatronWorker | None
    critic: MegatronWorker | None
    kl_ctrl: object | None
    kl_guard: TargetKLGuard | None
    tracker: Tracker
    dumper: object | None


def prepare_data(cfg) -> str | None:
    """Run the configured preprocessing (tiny default: GSM8K jsonl -> parquet, BPE tokenizer) when ITS OWN outputs
    are missing, then check that every data.train_files / data.val_files entry exists; returns the built
    tokenizer directory, if any.

    A wrong path is an error naming the key, before any model is built; it never triggers preprocessing (which
    would rewrite files that path does not even name). An entry may be a parquet file or a directory, which stands
    for its *.parquet files in name order (what PromptDataset reads).
    """
    pre = cfg.data.preprocess
    source = Path(pre.input_dir) if pre.input_dir else default_gsm8k_dir()
    if pre.dataset is not None:
        outputs = [Path(pre.output_dir) / f"{split}.parquet" for split in GSM8K_SPLITS]
        if not all(f.is_file() for f in outputs):
            counts = preprocess_gsm8k(source, pre.output_dir)
            log.info("preprocessed GSM8K from %s: %s", source, counts)
    for key in ("train_files", "val_files"):
        for i, entry in enumerate(getattr(cfg.data, key)):
            expand_parquet_paths(entry, what=f"data.{key}[{i}]")  # FileNotFoundError naming the key
    if pre.build_tokenizer:
        return str(gsm8k_tokenizer_dir(pre.output_dir, source, pre.tokenizer_vocab_size))
    return None


def model_arch(cfg, role: str, vocab_size: int) -> ModelArch:
    """The role's architecture: from its HF config.json (model.path) or inline (model.arch, random init)."""
    model = cfg.model_for(role)
    if model.path is not None:
        from megatron_ppo.convert.mapping import arch_from_hf_config

        arch = arch_from_hf_config(model.path)
        if arch.vocab_size < vocab_size:
            raise ValueError(f"{role}.model.path={model.path}: vocab_size {arch.vocab_size} is smaller than the "
                             f"tokenizer's {vocab_size} tokens")
        return arch
    fields = dataclasses.asdict(model.arch)
    fields["vocab_size"] = fields["vocab_size"] or vocab_size
    return ModelArch(**fields)


def params_dtype(cfg, role: str) -> torch.dtype:
    dtype = cfg.model_for(role).dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return DTYPES[dtype]


def total_training_steps(cfg, num_prompts: int) -> int:
    """trainer.total_training_steps, else total_epochs x full batches per epoch (verl's rule)."""
    return cfg.trainer.total_training_steps or max(num_prompts // cfg.data.train_batch_size, 1) * cfg.trainer.total_epochs


def recompute(cfg, role: str) -> dict | None:
    """The role's activation checkpointing (<role>.model.recompute_*) as models.gpt.build_gpt_model takes it."""
    model = cfg.model_for(role)
    if model.recompute_granularity is None:
        return None
    return {"granularity": model.recompute_granularity, **({"method": model.recompute_method,
            "num_layers": model.recompute_num_layers} if model.recompute_granularity == "full" else {})}


def build_worker(cfg, role: str, worker_role: str, vocab_size: int, *, optim=None, total_steps: int = 1):
    """A worker for ``role``, with HF weights loaded when the role's model has a path; a trainable role gets
    Megatron's DistributedOptimizer when cluster.<role>.use_distributed_optimizer (a frozen one has no optimizer)."""
    model_cfg = cfg.model_for(role)
    distributed = getattr(cfg.cluster, role).use_distributed_optimizer if optim is not None else False
    worker = MegatronWorker(worker_role, model_arch(cfg, role, vocab_size), optim=optim, total_steps=total_steps,
                            params_dtype=params_dtype(cfg, role), use_distributed_optimizer=distributed,
                            recompute=recompute(cfg, role))
    if model_cfg.path is not None:
        from megatron_ppo.trainer.hf_import import load_hf_weights

        cache = Path(cfg.trainer.expand(cfg.trainer.default_local_dir)) / "hf_import"
        load_hf_weights(worker.model, worker_role, model_cfg.path, str(cache))
    return worker


def build_components(cfg) -> Components:
    built_tokenizer = prepare_data(cfg)
    tokenizer = load_tokenizer(cfg.actor.model.tokenizer_path or built_tokenizer or cfg.actor.model.path)
    policy = overlong_policy_from_verl(cfg.data.filter_overlong_prompts, cfg.data.truncation)
    train = PromptDataset(cfg.data.train_files, tokenizer, cfg.data.max_prompt_length, policy,
                          cfg.data.prompt_key, cfg.data.train_max_samples)
    val = PromptDataset(cfg.data.val_files, tokenizer, cfg.data.max_prompt_length, policy, cfg.data.prompt_key,
                        cfg.data.val_max_samples) if cfg.data.val_files else None
    total_steps = total_training_steps(cfg, len(train))
    sampler = StatefulSampler(len(train), cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    vocab = len(tokenizer)
    actor = build_worker(cfg, "actor", "actor", vocab, optim=cfg.actor.optim, total_steps=total_steps)
    ref = None
    if cfg.use_reference and (cfg.ref.model.path or cfg.ref.model.arch):
        ref = build_worker(cfg, "ref", "reference", vocab)
    elif cfg.use_reference:
        ref = MegatronWorker("reference", model_arch(cfg, "ref", vocab), params_dtype=params_dtype(cfg, "ref"),
                             recompute=recompute(cfg, "ref"))
        ref.copy_weights_from(actor)  # the reference is the actor's initial policy (random or from HF)
    critic = None
    if cfg.use_critic:
        critic = build_worker(cfg, "critic", "critic", vocab, optim=cfg.critic.optim, total_steps=total_steps)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = None
    if cfg.algorithm.use_kl_in_reward:
        kwargs = {"fixed": {"kl_coef": kc.kl_coef},
                  "adaptive": {"init_kl_coef": kc.kl_coef, "target_kl": kc.target_kl, "horizon": kc.horizon},
                  "phased": {"phases": kc.phase_pairs(), "total_steps": total_steps}}[kc.type]
        kl_ctrl = build_kl_controller(kc.type, **kwargs)
    guard = TargetKLGuard(cfg.algorithm.kl_guard.target_kl) if cfg.algorithm.kl_guard.enable else None
    t = cfg.trainer
    tracker = Tracker(t.logger, t.expand(t.log_dir), t.project_name, t.experiment_name)
    dumper = None
    if cfg.rollout.dump_dir:
        writer = TrajectoryWriter(cfg.rollout.dump_dir, policy_name=t.experiment_name,
                                  temperature=cfg.rollout.temperature)
        dumper = lambda step, batch: writer.append(step, trajectory_rows(batch, tokenizer))  # noqa: E731
    eos = tokenizer.eos_token_id
    return Components(
        total_steps=total_steps, tokenizer=tokenizer, eos_token_ids=[eos] if eos is not None else [],
        train_dataset=train, val_dataset=val, sampler=sampler,
        scorer=RewardScorer.from_config(cfg.reward, cfg.data.max_response_length),
        actor=actor, ref=ref, critic=critic, kl_ctrl=kl_ctrl, kl_guard=guard, tracker=tracker, dumper=dumper)


def trajectory_rows(batch, tokenizer) -> dict:
    """A rollout batch as trajectory-parquet columns, for offline replay (rollout.dump_dir)."""
    lengths = batch.response_lengths.tolist()
    ids = [batch.responses[i, :n].tolist() for i, n in enumerate(lengths)]
    return {
        "prompt_ids": [p.tolist() for p in batch.prompt_ids],
        "response_ids": ids,
        "response": tokenizer.batch_decode(ids, skip_special_tokens=True),
        "rollout_log_probs": [batch.tensors["rollout_log_probs"][i, :n].tolist() for i, n in enumerate(lengths)],
        "reward": batch.tensors["sequence_scores"].tolist(),
        "prompt": batch.meta["raw_prompt"],
        "data_source": batch.meta["data_source"],
        "reward_model": batch.meta["reward_model"],
        "extra_info": batch.meta["extra_info"],
    }
