"""Everything the driver needs, built from the config: data, tokenizer, reward scorer, worker groups, controllers.

Kept apart from the loop so that ppo.py reads as a recipe. The models live in the worker groups (trainer/groups.py):
on Ray ranks or in this process; the driver holds only data, rewards and the KL controller.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ppo.algo.kl_control import build_kl_controller
from megatron_ppo.data.gsm8k import SPLITS as GSM8K_SPLITS
from megatron_ppo.data.gsm8k import default_gsm8k_dir
from megatron_ppo.data.parquet_io import expand_parquet_paths
from megatron_ppo.data.preprocess import preprocess_arithmetic, preprocess_gsm8k
from megatron_ppo.data.prompt_dataset import PromptDataset, overlong_policy_from_verl
from megatron_ppo.data.sampler import StatefulSampler
from megatron_ppo.data.tokenizer import gsm8k_tokenizer_dir, load_tokenizer, stop_token_ids
from megatron_ppo.data.trajectory import TrajectoryWriter
from megatron_ppo.plan.memory import total_params
from megatron_ppo.rewards.batch import RewardScorer
from megatron_ppo import roles
from megatron_ppo.convert.hf_import import convert_for_roles
from megatron_ppo.rollout.source import OfflineSource, OnlineSource, RolloutSource, sampling_params
from megatron_ppo.rollout.stop import ResponseStop
from megatron_ppo.trainer import progress
from megatron_ppo.trainer.groups import RoleGroups, build_groups
from megatron_ppo.trainer.run_record import write_run_record
from megatron_ppo.trainer.tracking import Tracker
from megatron_ppo.workers.build import model_arch

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Components:
    total_steps: int
    tokenizer: object
    eos_token_ids: list[int]
    source: RolloutSource  # the train rollouts: online (prompts -> the actor's engine) or offline (rollout.mode)
    val_source: OnlineSource | None  # validation: always generated (rollout.val_kwargs)
    sampler: StatefulSampler
    scorer: RewardScorer
    vocab_size: int
    groups: RoleGroups
    kl_ctrl: object | None
    tracker: Tracker
    dumper: object | None
    role_params: dict = None  # {role: parameters}: MFU's N (perf.step_perf_metrics)

    def __getattr__(self, name: str):
        """``parts.<role>``: the role's worker group, None when this run does not build it (roles.py names them)."""
        if name in roles.NAMES:
            return self.groups.get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def close(self) -> None:
        """The tracker, then the worker groups, their placement and a Ray cluster started for them."""
        try:
            self.tracker.close()
        finally:
            self.groups.close()


def check_reward_model_tokenizer(cfg, tokenizer) -> None:
    """The reward model reads the actor's token ids as they are (no re-tokenisation): an HF reward model directory
    that ships a tokenizer must ship the same one (same token -> id map)."""
    import glob
    import os

    from megatron_ppo.data.trajectory import tokenizer_fingerprint

    path = cfg.reward.reward_model.model.path
    if path is None or not glob.glob(os.path.join(path, "tokenizer*.json")):
        return
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(path)  # (no chat template needed: only the token -> id map is compared)
    if tokenizer_fingerprint(own) != tokenizer_fingerprint(tokenizer):
        raise ValueError(f"reward.reward_model.model.path={path}: its tokenizer ({len(own)} tokens) differs from the "
                         f"actor's ({len(tokenizer)} tokens); the reward model scores the actor's token ids as they "
                         "are, so it must use the actor's tokenizer (re-tokenising for another one is not supported)")


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
            if pre.dataset == "arithmetic":
                counts = preprocess_arithmetic(pre.output_dir, seed=cfg.data.seed)
            else:
                counts = preprocess_gsm8k(source, pre.output_dir)
            log.info("preprocessed %s into %s: %s", pre.dataset, pre.output_dir, counts)
    for key in ("train_files", "val_files"):
        for i, entry in enumerate(getattr(cfg.data, key)):
            expand_parquet_paths(entry, what=f"data.{key}[{i}]")  # FileNotFoundError naming the key
    if pre.build_tokenizer:
        return str(gsm8k_tokenizer_dir(pre.output_dir, source, pre.tokenizer_vocab_size))
    return None


def total_training_steps(cfg, num_prompts: int) -> int:
    """trainer.total_training_steps, else total_epochs x full batches per epoch (verl's rule)."""
    return cfg.trainer.total_training_steps or max(num_prompts // cfg.data.train_batch_size, 1) * cfg.trainer.total_epochs


def building_line(cfg) -> str:
    """What the next minutes are: 'building the roles on Ray: actor, critic, ref from models/X (each rank reads its
    own weight slices; the actor's rollout engine: megatron) ...'."""
    by_source: dict[str, list[str]] = {}
    for role in cfg.roles:
        path = cfg.model_for(role).path
        by_source.setdefault(f"from {path}" if path else "with random weights", []).append(role)
    models = "; ".join(f"{', '.join(rs)} {src}" for src, rs in by_source.items())
    where = "in this process" if cfg.cluster.launcher == "local" else "on Ray"
    notes = ["each rank reads its own weight slices"] if any(cfg.model_for(r).path for r in cfg.roles) else []
    if "actor" in cfg.roles:
        notes.append(f"the actor's rollout engine: {cfg.rollout.name}")
    return f"building the roles {where}: {models}" + (f" ({'; '.join(notes)})" if notes else "") + " ..."


def build_components(cfg, worker_classes: dict | None = None, resuming: bool = False) -> Components:
    """worker_classes: {role: class or import path} overriding the roles table's worker (tests); resuming:
    the run continues a checkpoint (its metrics.jsonl is appended to)."""
    start = time.monotonic()
    built_tokenizer = prepare_data(cfg)
    tokenizer = load_tokenizer(cfg.actor.model.tokenizer_path or built_tokenizer or cfg.actor.model.path)
    policy = overlong_policy_from_verl(cfg.data.filter_overlong_prompts, cfg.data.truncation)
    vocab = len(tokenizer)
    if cfg.rollout.mode == "offline":  # stored trajectories instead of prompts: no generation (rollout/offline.py)
        from megatron_ppo.rollout.offline import OfflineTrajectories

        train = OfflineTrajectories(cfg.rollout.trajectory_files, tokenizer, vocab, cfg.data.max_prompt_length,
                                    cfg.data.max_response_length, temperature=cfg.rollout.temperature)
    else:
        train = PromptDataset(cfg.data.train_files, tokenizer, cfg.data.max_prompt_length, policy,
                              cfg.data.prompt_key, cfg.data.train_max_samples)
    val = PromptDataset(cfg.data.val_files, tokenizer, cfg.data.max_prompt_length, policy, cfg.data.prompt_key,
                        cfg.data.val_max_samples) if cfg.data.val_files else None
    total_steps = total_training_steps(cfg, len(train))
    sampler = StatefulSampler(len(train), cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    role_params = {}  # each role's parameters, as the planner counts them: MFU's N (megatron_ppo/perf.py)
    for role in cfg.roles:
        arch = model_arch(cfg, role, vocab)  # an HF model with a smaller vocabulary fails here, before any rank starts
        role_params[role] = total_params(arch, role)
    if cfg.reward.reward_model.enable:
        check_reward_model_tokenizer(cfg, tokenizer)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = None
    if cfg.algorithm.use_kl_in_reward:
        kwargs = {"fixed": {"kl_coef": kc.kl_coef},
                  "adaptive": {"kl_coef": kc.kl_coef, "target_kl": kc.target_kl, "horizon": kc.horizon},
                  "phased": {"phases": kc.phase_pairs(), "total_steps": total_steps}}[kc.type]
        kl_ctrl = build_kl_controller(kc.type, **kwargs)
    t = cfg.trainer
    tracker = Tracker(t.logger, t.expand(t.log_dir), t.project_name, t.experiment_name, append=resuming)
    dumper = None
    if cfg.rollout.dump_dir:
        writer = TrajectoryWriter(cfg.rollout.dump_dir, policy_name=t.experiment_name,
                                  temperature=cfg.rollout.temperature, tokenizer=tokenizer)
        dumper = lambda step, batch: writer.append(step, trajectory_rows(batch, tokenizer))  # noqa: E731
    convert_for_roles(cfg, cfg.roles)  # HF headers checked before any rank starts; each rank reads its own slices
    # after every driver-side check (a refusal stays the only line), before the minutes of rank start-up
    progress.announce("data: %d train %s, %s validation prompts (read and checked in %s)", len(train),
                      "trajectories" if cfg.rollout.mode == "offline" else "prompts", len(val) if val else "no",
                      progress.duration(time.monotonic() - start))
    progress.announce("%s", building_line(cfg))
    try:  # last: the groups are what needs closing
        groups = build_groups(cfg, vocab, total_steps, worker_classes)
    except BaseException:
        tracker.close()
        raise
    write_run_record(tracker.log_dir, cfg, {role: g.layout for role, g in groups.groups.items()},
                     {role: g.threads for role, g in groups.groups.items()})
    eos_ids = stop_token_ids(tokenizer, cfg.actor.model.path)
    balance, max_len, pad = cfg.trainer.balance_batch, cfg.data.max_response_length, tokenizer.pad_token_id
    actor = groups.get("actor")
    stop = ResponseStop.from_config(cfg.rollout, tokenizer)
    source = OfflineSource(train) if cfg.rollout.mode == "offline" else OnlineSource(
        train, actor, sampling_params(cfg.rollout, max_len, eos_ids, pad), cfg.rollout.n, balance, stop)
    val_source = None if val is None else OnlineSource(
        val, actor, sampling_params(cfg.rollout.val_kwargs, max_len, eos_ids, pad), cfg.rollout.val_kwargs.n, balance,
        stop)
    return Components(
        total_steps=total_steps, tokenizer=tokenizer, eos_token_ids=eos_ids,
        source=source, val_source=val_source, sampler=sampler,
        scorer=RewardScorer.from_config(cfg.reward, cfg.data.max_response_length),
        vocab_size=vocab, groups=groups, kl_ctrl=kl_ctrl, tracker=tracker, dumper=dumper, role_params=role_params)


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
