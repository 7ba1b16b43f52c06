"""Value and cross-key rules of the PPO config: everything a type hint cannot say.

Each rule names the full dotted key, the value it saw and what is allowed. A setting that would be silently
ignored (a threshold without its switch, phases for a non-phased controller) is an error too.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Optional

from .io import ConfigError
from .schema import ArchConfig, ModelConfig, OptimConfig, PPOConfig, RolloutConfig, SamplingConfig

log = logging.getLogger(__name__)


class _Errors(list):
    def check(self, ok: bool, key: str, message: str) -> None:
        if not ok:
            self.append(f"{key}: {message}")

    def positive(self, key: str, value: Optional[float], allow_none: bool = False) -> None:
        if value is None and allow_none:
            return
        self.check(value is not None and value > 0, key, f"must be > 0, got {value}")

    def non_negative(self, key: str, value: float) -> None:
        self.check(value >= 0, key, f"must be >= 0, got {value}")

    def unit_interval(self, key: str, value: float) -> None:
        self.check(0.0 <= value <= 1.0, key, f"must be in [0, 1], got {value}")

    def minus_one_or_positive(self, key: str, value: int, meaning: str) -> None:
        self.check(value == -1 or value >= 1, key, f"must be -1 ({meaning}) or >= 1, got {value}")


def validate(cfg: PPOConfig, source: Optional[str] = None) -> None:
    """Raise ConfigError listing every broken rule; return None for a valid config."""
    errs = _Errors()
    _data(cfg, errs)
    _models(cfg, errs)
    _batches(cfg, errs)
    _actor(cfg, errs)
    _critic(cfg, errs)
    _reward(cfg, errs)
    _rollout(cfg, errs)
    _algorithm(cfg, errs)
    _trainer(cfg, errs)
    _profiler(cfg, errs)
    _cluster(cfg, errs)
    if errs:
        raise ConfigError(list(dict.fromkeys(errs)), source)  # same rule hit twice (shared arch): once


def _data(cfg: PPOConfig, errs: _Errors) -> None:
    d = cfg.data
    for key in ("max_prompt_length", "max_response_length", "train_batch_size"):
        errs.positive(f"data.{key}", getattr(d, key))
    errs.positive("data.val_batch_size", d.val_batch_size, allow_none=True)
    errs.minus_one_or_positive("data.train_max_samples", d.train_max_samples, "all")
    errs.minus_one_or_positive("data.val_max_samples", d.val_max_samples, "all")
    errs.check(bool(d.prompt_key), "data.prompt_key", "must be a column name, got an empty string")
    errs.check(bool(d.reward_fn_key), "data.reward_fn_key", "must be a column name, got an empty string")
    for key in ("train_files", "val_files"):
        for i, path in enumerate(getattr(d, key)):
            errs.check(bool(path.strip()), f"data.{key}[{i}]", "must be a file path, got an empty string")
    if cfg.rollout.mode == "online":
        errs.check(bool(d.train_files), "data.train_files", "required when rollout.mode=online "
                   "(one or more verl-schema prompt parquet files)")
    p = d.preprocess
    if p.dataset is not None or p.build_tokenizer:
        errs.check(p.output_dir is not None, "data.preprocess.output_dir", "required with data.preprocess.dataset "
                   "or data.preprocess.build_tokenizer (where the built files go)")
    if p.build_tokenizer:
        errs.check(cfg.actor.model.tokenizer_path is None, "actor.model.tokenizer_path", "must be null with "
                   "data.preprocess.build_tokenizer=true (the built tokenizer is used); set one of the two")
    errs.check(p.tokenizer_vocab_size >= 256, "data.preprocess.tokenizer_vocab_size",
               f"must be >= 256 (the byte alphabet), got {p.tokenizer_vocab_size}")


def _models(cfg: PPOConfig, errs: _Errors) -> None:
    from megatron_ppo import roles

    for spec in roles.ROLES:
        key, role, model = spec.model_key, spec.name, spec.own_model_config(cfg)
        errs.check(not (model.path and model.arch), key, "set either path (HF directory) or arch (inline "
                   "architecture), not both")
        _recompute(key, model, errs)
        arch = cfg.model_for(role).arch  # a critic/ref without its own weights runs the actor's architecture
        if arch is not None:
            owner = key if model.arch is not None else "actor.model"
            _arch(f"{owner}.arch", arch, getattr(cfg.cluster, role), f"cluster.{role}", cfg, errs)
    errs.check(bool(cfg.actor.model.path or cfg.actor.model.arch), "actor.model",
               "set path (HF model directory) or arch (inline architecture)")
    if cfg.actor.model.arch is not None and not cfg.actor.model.path and not cfg.data.preprocess.build_tokenizer:
        errs.check(cfg.actor.model.tokenizer_path is not None, "actor.model.tokenizer_path",
                   "required when actor.model.arch is inline (there is no HF directory to read a tokenizer from) "
                   "unless data.preprocess.build_tokenizer=true")
    rm = cfg.reward.reward_model
    if rm.enable:
        errs.check(bool(rm.model.path or rm.model.arch), "reward.reward_model.model",
                   "set path or arch when reward.reward_model.enable=true")
    errs.positive("reward.reward_model.micro_batch_size_per_gpu", rm.micro_batch_size_per_gpu, allow_none=True)


def _recompute(key: str, model: ModelConfig, errs: _Errors) -> None:
    if model.recompute_granularity == "full":
        errs.check(model.recompute_method is not None, f"{key}.recompute_method",
                   "required with recompute_granularity=full; one of ['uniform', 'block']")
        errs.check(model.recompute_num_layers is not None and model.recompute_num_layers >= 1,
                   f"{key}.recompute_num_layers", f"must be >= 1 with recompute_granularity=full, "
                   f"got {model.recompute_num_layers}")
    else:
        for name in ("recompute_method", "recompute_num_layers"):
            errs.check(getattr(model, name) is None, f"{key}.{name}",
                       f"only used with recompute_granularity=full (it is {model.recompute_granularity}); set null")


def _arch(key: str, arch: ArchConfig, parallel, parallel_key: str, cfg: PPOConfig, errs: _Errors) -> None:
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "max_position_embeddings"):
        errs.positive(f"{key}.{name}", getattr(arch, name))
    errs.positive(f"{key}.vocab_size", arch.vocab_size, allow_none=True)
    errs.positive(f"{key}.rotary_base", arch.rotary_base)
    errs.positive(f"{key}.norm_epsilon", arch.norm_epsilon)
    if arch.num_attention_heads > 0 and arch.num_query_groups > 0:
        errs.check(arch.hidden_size % arch.num_attention_heads == 0, f"{key}.hidden_size",
                   f"must be divisible by num_attention_heads ({arch.num_attention_heads}), got {arch.hidden_size}")
        errs.check(arch.num_attention_heads % arch.num_query_groups == 0, f"{key}.num_query_groups",
                   f"must divide num_attention_heads ({arch.num_attention_heads}), got {arch.num_query_groups}")
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    errs.check(arch.max_position_embeddings >= seq, f"{key}.max_position_embeddings",
               f"must be >= data.max_prompt_length + data.max_response_length ({seq}), "
               f"got {arch.max_position_embeddings}")
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if tp >= 1 and pp >= 1:
        for name, count, size_key, size in layout_split_problems(
                tp, pp, {n: getattr(arch, n) for n in TP_SPLIT_COUNTS}, {n: getattr(arch, n) for n in PP_SPLIT_COUNTS}):
            errs.append(f"{key}.{name}: must be divisible by {parallel_key}.{size_key} ({size}), got {count}")


# What a TP x PP layout splits, in ArchConfig's names: megatron-core (models/gpt.py) refuses a layout whose
# tensor_model_parallel_size does not divide each TP count or whose pipeline_model_parallel_size does not divide each
# PP count. Shared by `arch:` configs (_arch) and HF model directories (trainer/preflight.py, from config.json).
TP_SPLIT_COUNTS = ("num_attention_heads", "num_query_groups")
PP_SPLIT_COUNTS = ("num_layers",)


def layout_split_problems(tp: int, pp: int, tp_counts: dict[str, int],
                          pp_counts: dict[str, int]) -> list[tuple[str, int, str, int]]:
    """(count name, count, layout key, size) for every count the layout cannot split evenly: each of tp_counts that
    tensor_model_parallel_size=tp does not divide, then each of pp_counts that pipeline_model_parallel_size=pp does
    not divide, in the order given. A size < 1 is reported elsewhere (its counts are skipped)."""
    problems = []
    for counts, size_key, size in ((tp_counts, "tensor_model_parallel_size", tp),
                                   (pp_counts, "pipeline_model_parallel_size", pp)):
        if size >= 1:
            problems += [(name, count, size_key, size) for name, count in counts.items() if count % size]
    return problems


def sizes_that_split(counts) -> list[int]:
    """The layout sizes that divide every one of `counts` (positive ints): the divisors of their gcd, ascending."""
    g = math.gcd(*counts)
    return [d for d in range(1, g + 1) if g % d == 0]


def _optim(key: str, o: OptimConfig, errs: _Errors) -> None:
    errs.non_negative(f"{key}.lr", o.lr)
    errs.non_negative(f"{key}.min_lr", o.min_lr)
    errs.check(o.min_lr <= o.lr or o.lr_decay_style == "constant", f"{key}.min_lr",
               f"must be <= {key}.lr ({o.lr}), got {o.min_lr}")
    errs.non_negative(f"{key}.lr_warmup_init", o.lr_warmup_init)
    errs.unit_interval(f"{key}.lr_warmup_steps_ratio", o.lr_warmup_steps_ratio)
    errs.positive(f"{key}.lr_decay_steps", o.lr_decay_steps, allow_none=True)
    errs.non_negative(f"{key}.weight_decay", o.weight_decay)
    errs.non_negative(f"{key}.clip_grad", o.clip_grad)
    errs.check(len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), f"{key}.betas",
               f"must be two numbers in [0, 1), got {o.betas}")


def _data_parallel(cfg: PPOConfig, role: str) -> Optional[int]:
    dp = cfg.cluster.data_parallel(role)
    return dp if dp is not None and dp >= 1 else None  # else reported by _cluster


def _micro_batches(key: str, role: str, mini: int, micro: Optional[int], dynamic: bool, max_tokens: int,
                   micro_name: str, tokens_name: str, cfg: PPOConfig, errs: _Errors) -> None:
    """mini prompts x rollout.n sequences split over the role's data-parallel ranks, then into micro-batches."""
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    if dynamic:
        errs.check(max_tokens >= seq, f"{key}.{tokens_name}", f"must hold one full sequence: >= "
                   f"data.max_prompt_length + data.max_response_length ({seq}), got {max_tokens}")
        return
    if micro is None:
        errs.append(f"{key}.{micro_name}: required unless use_dynamic_bsz is true")
        return
    errs.positive(f"{key}.{micro_name}", micro)
    dp = _data_parallel(cfg, role)
    if mini is None or mini < 1 or micro < 1 or dp is None:
        return
    sequences = mini * cfg.rollout.n
    if sequences % dp:
        errs.append(f"{key}.ppo_mini_batch_size: {mini} prompts x rollout.n {cfg.rollout.n} = {sequences} "
                    f"sequences must split evenly over {dp} data-parallel ranks")
    elif (sequences // dp) % micro:
        errs.append(f"{key}.{micro_name}: must divide the per-rank mini-batch ({sequences // dp} sequences), "
                    f"got {micro}")


def _batches(cfg: PPOConfig, errs: _Errors) -> None:
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.use_critic else [])
    for key, role in roles:
        errs.positive(f"{key}.ppo_mini_batch_size", role.ppo_mini_batch_size)
        errs.positive(f"{key}.ppo_epochs", role.ppo_epochs)
        if role.ppo_mini_batch_size >= 1:
            errs.check(cfg.data.train_batch_size % role.ppo_mini_batch_size == 0, f"{key}.ppo_mini_batch_size",
                       f"must divide data.train_batch_size ({cfg.data.train_batch_size}), "
                       f"got {role.ppo_mini_batch_size}")
        _micro_batches(key, key, role.ppo_mini_batch_size, role.ppo_micro_batch_size_per_gpu, role.use_dynamic_bsz,
                       role.ppo_max_token_len_per_gpu, "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
                       cfg, errs)
    forward_only = [("rollout", "actor", cfg.rollout)] + ([("ref", "ref", cfg.ref)] if cfg.use_reference else [])
    for key, role, c in forward_only:
        _micro_batches(key, role, None, c.log_prob_micro_batch_size_per_gpu, c.log_prob_use_dynamic_bsz,
                       c.log_prob_max_token_len_per_gpu, "log_prob_micro_batch_size_per_gpu",
                       "log_prob_max_token_len_per_gpu", cfg, errs)


def _actor(cfg: PPOConfig, errs: _Errors) -> None:
    a = cfg.actor
    _optim("actor.optim", a.optim, errs)
    errs.check(0 < a.clip_ratio < 1, "actor.clip_ratio", f"must be in (0, 1), got {a.clip_ratio}")
    if a.clip_ratio_low is not None:
        errs.check(0 < a.clip_ratio_low < 1, "actor.clip_ratio_low", f"must be in (0, 1), got {a.clip_ratio_low}")
    errs.positive("actor.clip_ratio_high", a.clip_ratio_high, allow_none=True)
    errs.check(a.clip_ratio_c > 1.0, "actor.clip_ratio_c", f"must be > 1.0 (dual-clip bound on the ratio for "
               f"negative advantages), got {a.clip_ratio_c}")
    errs.positive("actor.loss_scale_factor", a.loss_scale_factor, allow_none=True)
    errs.check(a.loss_scale_factor is None or a.loss_agg_mode == "seq-mean-token-sum-norm",
               "actor.loss_scale_factor", f"only used with loss_agg_mode=seq-mean-token-sum-norm "
               f"(it is {a.loss_agg_mode}); set null")
    errs.non_negative("actor.entropy_coeff", a.entropy_coeff)
    errs.positive("actor.entropy_from_logits_chunk_size", a.entropy_from_logits_chunk_size)
    errs.non_negative("actor.kl_loss_coef", a.kl_loss_coef)


def _critic(cfg: PPOConfig, errs: _Errors) -> None:
    c = cfg.critic
    errs.check(not (c.enable is False and cfg.algorithm.adv_estimator == "gae"), "critic.enable",
               "must not be false with algorithm.adv_estimator=gae (GAE needs the critic's values)")
    _optim("critic.optim", c.optim, errs)
    errs.positive("critic.cliprange_value", c.cliprange_value)
    errs.check(cfg.use_critic or cfg.trainer.critic_warmup == 0, "trainer.critic_warmup",
               f"must be 0 without a critic (algorithm.adv_estimator={cfg.algorithm.adv_estimator}), "
               f"got {cfg.trainer.critic_warmup}")


def _reward(cfg: PPOConfig, errs: _Errors) -> None:
    r = cfg.reward
    errs.check(0 <= r.format_score <= r.score, "reward.format_score",
               f"must be in [0, reward.score ({r.score})], got {r.format_score}")
    errs.non_negative("reward.length_penalty_coef", r.length_penalty_coef)
    max_length = cfg.data.max_response_length
    errs.check(r.length_penalty_buffer is None or 0 < r.length_penalty_buffer <= max_length,
               "reward.length_penalty_buffer", f"must be in [1, data.max_response_length ({max_length})] or null, "
               f"got {r.length_penalty_buffer}")
    errs.check(r.length_penalty_buffer is None or r.length_penalty_coef > 0, "reward.length_penalty_buffer",
               f"is set ({r.length_penalty_buffer}) but reward.length_penalty_coef is 0, so no penalty applies; "
               "set the coefficient (verl: overlong_buffer.penalty_factor)")
    errs.non_negative("reward.repetition_penalty_coef", r.repetition_penalty_coef)
    errs.positive("reward.repetition_ngram_size", r.repetition_ngram_size)
    custom = r.custom_reward_function
    errs.check(bool(custom.name), "reward.custom_reward_function.name",
               "must be a function name, got an empty string")
    default_name = type(custom)().name
    errs.check(custom.path is not None or custom.name in ("", default_name), "reward.custom_reward_function.name",
               f"only used with reward.custom_reward_function.path (it is null), got {custom.name!r}; set the path "
               "of the Python file that defines it, or remove the name")


def _sampling(key: str, s: SamplingConfig, errs: _Errors) -> None:
    if s.do_sample:
        errs.check(s.temperature > 0, f"{key}.temperature", f"must be > 0 when do_sample is true, got "
                   f"{s.temperature}")
    else:
        errs.non_negative(f"{key}.temperature", s.temperature)
    errs.check(0 < s.top_p <= 1, f"{key}.top_p", f"must be in (0, 1], got {s.top_p}")
    errs.minus_one_or_positive(f"{key}.top_k", s.top_k, "off")
    errs.positive(f"{key}.n", s.n)


def _rollout(cfg: PPOConfig, errs: _Errors) -> None:
    r: RolloutConfig = cfg.rollout
    _sampling("rollout", r, errs)
    _sampling("rollout.val_kwargs", r.val_kwargs, errs)
    if r.mode == "offline":
        errs.check(bool(r.trajectory_files), "rollout.trajectory_files", "required when rollout.mode=offline "
                   "(one or more trajectory parquet files)")
        # GRPO groups / n samples per prompt would silently be groups of one row
        errs.check(r.n == 1, "rollout.n", f"must be 1 with rollout.mode=offline (each stored trajectory is one "
                   f"response; and a GAE advantage estimator), got {r.n}")
    else:
        errs.check(not r.trajectory_files, "rollout.trajectory_files", "only read when rollout.mode=offline "
                   "(it is online); remove them or set rollout.mode=offline")
    if r.stop_pattern is not None:
        from megatron_ppo.rollout.stop import compile_stop_pattern

        try:
            compile_stop_pattern(r.stop_pattern)
        except ValueError as exc:
            errs.append(str(exc))
    if r.name == "vllm":
        _vllm(cfg, errs)
    m = r.megatron
    errs.check(m.alive_check_interval >= 1, "rollout.megatron.alive_check_interval", "must be >= 1")
    errs.check(m.prefill_token_budget >= 1, "rollout.megatron.prefill_token_budget", "must be >= 1")
    errs.check(m.max_num_seqs >= 1, "rollout.megatron.max_num_seqs", "must be >= 1")
    errs.check(not (m.cuda_graphs is True and cfg.cluster.device == "cpu"), "rollout.megatron.cuda_graphs",
               "true needs a CUDA device (cluster.device=cpu); auto turns CUDA graphs on where there is one")
    errs.check(all(b >= 1 for b in m.batch_buckets), "rollout.megatron.batch_buckets",
               f"sizes must be >= 1, got {m.batch_buckets}")
    if cfg.algorithm.adv_estimator == "grpo":
        errs.check(r.n >= 2, "rollout.n", f"must be >= 2 with algorithm.adv_estimator=grpo (advantages are "
                   f"relative to the group of responses), got {r.n}")


def _vllm(cfg: PPOConfig, errs: _Errors) -> None:
    v = cfg.rollout.vllm
    for key, s in (("rollout", cfg.rollout), ("rollout.val_kwargs", cfg.rollout.val_kwargs)):
        # vLLM reports a sampled token's log-prob before temperature or after temperature and top-k/top-p; the
        # trainer's is log_softmax(logits / T) over the full vocabulary (rollout/vllm.logprobs_mode)
        errs.check(not (s.do_sample and (s.top_k > 0 or s.top_p < 1.0) and s.temperature != 1.0),
                   f"{key}.temperature", f"with rollout.name=vllm and top_k/top_p on, must be 1.0 (vLLM cannot report "
                   f"log_softmax(logits / T) of a truncated distribution), got {s.temperature}")
    if v.tensor_model_parallel_size is not None:
        errs.positive("rollout.vllm.tensor_model_parallel_size", v.tensor_model_parallel_size)
    errs.positive("rollout.vllm.pipeline_model_parallel_size", v.pipeline_model_parallel_size)
    errs.check(0 < v.gpu_memory_utilization <= 1, "rollout.vllm.gpu_memory_utilization",
               f"must be in (0, 1], got {v.gpu_memory_utilization}")
    errs.check(v.cpu_kv_cache_gib > 0, "rollout.vllm.cpu_kv_cache_gib", f"must be > 0, got {v.cpu_kv_cache_gib}")
    errs.positive("rollout.vllm.max_num_seqs", v.max_num_seqs)
    if v.cpu_threads_bind is not None:
        errs.check(re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", v.cpu_threads_bind) is not None,
                   "rollout.vllm.cpu_threads_bind", f"must list cores like '0', '0-3' or '0,2-3', got "
                   f"{v.cpu_threads_bind!r}")
    errs.positive("rollout.vllm.bucket_mb", v.bucket_mb)
    errs.check(v.start_timeout_s > 0, "rollout.vllm.start_timeout_s", f"must be > 0, got {v.start_timeout_s}")
    errs.check(v.hang_timeout_s > 0, "rollout.vllm.hang_timeout_s", f"must be > 0, got {v.hang_timeout_s}")


def _algorithm(cfg: PPOConfig, errs: _Errors) -> None:
    a = cfg.algorithm
    errs.unit_interval("algorithm.gamma", a.gamma)
    errs.unit_interval("algorithm.lam", a.lam)
    k = a.kl_ctrl
    errs.non_negative("algorithm.kl_ctrl.kl_coef", k.kl_coef)
    errs.positive("algorithm.kl_ctrl.horizon", k.horizon)
    errs.positive("algorithm.kl_ctrl.target_kl", k.target_kl)
    if k.type != "phased":
        errs.check(not k.phases, "algorithm.kl_ctrl.phases", f"only used with algorithm.kl_ctrl.type=phased "
                   f"(it is {k.type}); remove them or set the type")
    elif not k.phases:
        errs.append("algorithm.kl_ctrl.phases: required with algorithm.kl_ctrl.type=phased, e.g. "
                    "[{until: 0.2, coef: 0.08}, {until: 0.8, coef: 0.05}, {until: 1.0, coef: 0.06}]")
    else:
        previous = 0.0
        for i, phase in enumerate(k.phases):
            errs.check(previous < phase.until <= 1.0, f"algorithm.kl_ctrl.phases[{i}].until",
                       f"must increase strictly within (0, 1]: previous {previous}, got {phase.until}")
            errs.non_negative(f"algorithm.kl_ctrl.phases[{i}].coef", phase.coef)
            previous = max(previous, phase.until)
        errs.check(k.phases[-1].until == 1.0, f"algorithm.kl_ctrl.phases[{len(k.phases) - 1}].until",
                   f"the last phase must end at 1.0 (the end of training), got {k.phases[-1].until}")
    errs.positive("algorithm.kl_guard.target_kl", a.kl_guard.target_kl)
    _rollout_correction(a.rollout_correction, errs)


def _rollout_correction(rc, errs: _Errors) -> None:
    """Threshold syntax is algo.rollout_correction's own parser (verl's syntax), imported only when needed."""
    key = "algorithm.rollout_correction"
    threshold = rc.rollout_is_threshold
    if isinstance(threshold, str):
        from ..algo.rollout_correction import parse_is_threshold

        try:
            parse_is_threshold(threshold)
        except ValueError as exc:
            errs.append(f"{key}.rollout_is_threshold: {exc}")
    else:
        errs.check(0 < threshold < float("inf"), f"{key}.rollout_is_threshold",
                   f"must be > 0 and finite, got {threshold}")
    errs.check(rc.rollout_is is not None or not rc.rollout_is_batch_normalize, f"{key}.rollout_is_batch_normalize",
               f"only used when {key}.rollout_is is token or sequence (it is null)")
    errs.check(rc.loss_type in ("ppo_clip", "reinforce"), f"{key}.loss_type",
               f"must be ppo_clip or reinforce, got {rc.loss_type!r}")
    errs.check(rc.bypass_mode or rc.loss_type == "ppo_clip", f"{key}.loss_type",
               f"{rc.loss_type} is only used with {key}.bypass_mode=true (it is false: the policy loss is PPO's "
               "clipped objective with the recomputed old log-probs)")
    if rc.rollout_rs is None:
        errs.check(rc.rollout_rs_threshold is None, f"{key}.rollout_rs_threshold",
                   f"only used when {key}.rollout_rs is set (it is null)")
        return
    from ..algo.rollout_correction import parse_rs_options, parse_rs_thresholds

    try:
        options = parse_rs_options(rc.rollout_rs)
    except ValueError as exc:
        errs.append(f"{key}.rollout_rs: {exc}")
        return
    try:
        parse_rs_thresholds(options, rc.rollout_rs_threshold)
    except ValueError as exc:
        errs.append(f"{key}.rollout_rs_threshold: {exc}")


def _async_rollout(cfg: PPOConfig, errs: _Errors) -> None:
    """trainer.async_rollout=one_step overlaps step k+1's generation with step k's training: only where the two can
    run at once (docs/trainer.md, "One step off-policy")."""
    t = cfg.trainer
    errs.check(t.max_staleness in (0, 1), "trainer.max_staleness", f"must be 0 or 1 (at most one rollout is in "
               f"flight: one_step), got {t.max_staleness}")
    if t.async_rollout == "off":
        return
    errs.check(cfg.rollout.mode == "online", "trainer.async_rollout", "one_step overlaps generation with training; "
               "rollout.mode=offline generates nothing (set trainer.async_rollout=off)")
    errs.check(cfg.rollout.name == "vllm", "trainer.async_rollout", f"one_step needs rollout.name=vllm, got "
               f"{cfg.rollout.name!r}: the Megatron engine generates inside the actor's own ranks, which step k's "
               "evaluate and updates occupy, so nothing could overlap (vLLM generates in a process of its own)")


def _profiler(cfg: PPOConfig, errs: _Errors) -> None:
    g = cfg.global_profiler
    for step in g.steps or []:
        errs.check(isinstance(step, int) and step >= 1, "global_profiler.steps", f"steps are 1-based, got {step}")
    for rank in g.ranks or []:
        errs.check(isinstance(rank, int) and rank >= 0, "global_profiler.ranks", f"ranks are >= 0, got {rank}")
    if g.tool is not None:
        errs.check(bool(g.steps), "global_profiler.steps", f"empty with global_profiler.tool={g.tool}: name the steps "
                   "to profile, e.g. global_profiler.steps=[2,3]")
    errs.check(g.tool != "torch_memory" or cfg.cluster.device != "cpu", "global_profiler.tool",
               "torch_memory records CUDA allocations: it needs cluster.device=cuda (or auto on a GPU machine)")
    if cfg.trainer.peak_tflops is not None:
        errs.check(cfg.trainer.peak_tflops > 0, "trainer.peak_tflops", f"must be > 0, got {cfg.trainer.peak_tflops}")


def _trainer(cfg: PPOConfig, errs: _Errors) -> None:
    t = cfg.trainer
    errs.positive("trainer.total_epochs", t.total_epochs)
    errs.positive("trainer.total_training_steps", t.total_training_steps, allow_none=True)
    errs.non_negative("trainer.critic_warmup", t.critic_warmup)
    errs.minus_one_or_positive("trainer.max_consecutive_skips", t.max_consecutive_skips, "never stop")
    errs.minus_one_or_positive("trainer.save_freq", t.save_freq, "only at the end")
    errs.minus_one_or_positive("trainer.test_freq", t.test_freq, "off")
    if not cfg.data.val_files:
        errs.check(t.test_freq < 1, "trainer.test_freq", f"validates every {t.test_freq} steps but data.val_files is "
                   "empty; set data.val_files or trainer.test_freq=-1")
        if t.val_before_train:  # verl's default is true: a warning, not an error, for configs without val files
            log.warning("trainer.val_before_train=true does nothing: data.val_files is empty (no validation runs); "
                        "set data.val_files or trainer.val_before_train=false")
    errs.non_negative("trainer.log_val_generations", t.log_val_generations)
    if t.save_best:
        errs.check(t.test_freq > 0 and bool(cfg.data.val_files), "trainer.save_best",
                   f"keeps the best validated step, but nothing validates during training (trainer.test_freq="
                   f"{t.test_freq}, data.val_files {'set' if cfg.data.val_files else 'empty'}); set test_freq > 0 "
                   "and data.val_files, or save_best=false")
    if t.best_metric is not None:
        errs.check(t.best_metric.startswith("val/"), "trainer.best_metric",
                   f"{t.best_metric!r} is not a validation metric; name one the run logs, e.g. "
                   "val/test_score/<data_source>")
    _async_rollout(cfg, errs)
    duplicates = sorted({x for x in t.logger if t.logger.count(x) > 1})
    errs.check(not duplicates, "trainer.logger", f"lists {duplicates} more than once")
    for key in ("log_dir", "default_local_dir"):
        try:
            t.expand(getattr(t, key))
        except (KeyError, IndexError, ValueError) as exc:
            errs.append(f"trainer.{key}: only {{project_name}} and {{experiment_name}} may appear in braces "
                        f"({exc.__class__.__name__}: {exc})")
    if t.resume_mode == "resume_path":
        errs.check(bool(t.resume_from_path), "trainer.resume_from_path", "required with resume_mode=resume_path")
    else:
        errs.check(t.resume_from_path is None, "trainer.resume_from_path",
                   f"only used with trainer.resume_mode=resume_path (it is {t.resume_mode})")
    errs.positive("trainer.max_actor_ckpt_to_keep", t.max_actor_ckpt_to_keep, allow_none=True)
    errs.positive("trainer.max_critic_ckpt_to_keep", t.max_critic_ckpt_to_keep, allow_none=True)


def _cluster(cfg: PPOConfig, errs: _Errors) -> None:
    c = cfg.cluster
    errs.positive("cluster.nnodes", c.nnodes)
    errs.positive("cluster.n_gpus_per_node", c.n_gpus_per_node)
    if c.num_cpus_per_rank != "auto":
        errs.positive("cluster.num_cpus_per_rank", c.num_cpus_per_rank)
    errs.check(c.num_gpus_per_rank is None or c.num_gpus_per_rank >= 0, "cluster.num_gpus_per_rank",
               f"must be >= 0 or null, got {c.num_gpus_per_rank}")
    errs.positive("cluster.collective_timeout_s", c.collective_timeout_s)
    errs.positive("cluster.nccl_timeout_s", c.nccl_timeout_s)
    timeouts = (c.nccl_timeout_s, c.collective_timeout_s)
    if c.device != "cpu" and all(isinstance(t, (int, float)) and t > 0 for t in timeouts):  # cpu: NCCL never runs
        errs.check(c.nccl_timeout_s >= c.collective_timeout_s, "cluster.nccl_timeout_s",
                   f"{c.nccl_timeout_s:g} s is shorter than cluster.collective_timeout_s "
                   f"({c.collective_timeout_s:g} s), but on GPUs every group times out after nccl_timeout_s "
                   "(collective_timeout_s is gloo's) and NCCL's groups carry the run's longest waits, checkpoint "
                   f"saves and loads: set cluster.nccl_timeout_s to at least {c.collective_timeout_s:g}")
    errs.check(0 <= c.release_heap_below_available < 1, "cluster.release_heap_below_available",
               f"must be a fraction in [0, 1) (0: never), got {c.release_heap_below_available}")
    from megatron_ppo import roles

    for role in roles.NAMES:
        p = getattr(c, role)
        key = f"cluster.{role}"
        errs.positive(f"{key}.tensor_model_parallel_size", p.tensor_model_parallel_size)
        errs.positive(f"{key}.pipeline_model_parallel_size", p.pipeline_model_parallel_size)
        errs.positive(f"{key}.data_parallel_size", p.data_parallel_size, allow_none=True)
        shard = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        if shard >= 1 and c.world_size >= 1 and p.data_parallel_size is None and c.launcher == "ray":
            errs.check(c.world_size % shard == 0, key, f"tensor_model_parallel_size x pipeline_model_parallel_size "
                       f"= {shard} must divide the world size (cluster.nnodes x cluster.n_gpus_per_node = "
                       f"{c.world_size}), or set {key}.data_parallel_size")
        if c.launcher == "local" and shard >= 1:
            dp = c.data_parallel(role) or 1
            errs.check(shard * dp == 1, key, f"cluster.launcher=local runs one in-process rank per role, but "
                       f"TP={p.tensor_model_parallel_size} x PP={p.pipeline_model_parallel_size} x DP={dp} = "
                       f"{shard * dp} ranks; use cluster.launcher=ray")
        errs.check(not p.sequence_parallel or p.tensor_model_parallel_size > 1, f"{key}.sequence_parallel",
                   "needs tensor_model_parallel_size > 1 (it is 1); set it false")
    if cfg.use_reference and cfg.ref.model.path is None and cfg.ref.model.arch is None \
            and cfg.actor.model.path is None:
        a, r = c.actor, c.ref
        same = (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (
            r.tensor_model_parallel_size, r.pipeline_model_parallel_size)
        errs.check(same, "cluster.ref", "the reference starts from the actor's random initialisation, which is "
                   "reproduced only at the same TP x PP: set cluster.ref.tensor_model_parallel_size / "
                   "pipeline_model_parallel_size equal to cluster.actor's, or give ref.model.path")


def unsupported_settings(cfg) -> list[str]:
    """Settings the driver would otherwise ignore silently: each is refused, by name."""
    checks = {
        # read nowhere else in the driver or the workers (tests/integration/test_config_keys_reach_code.py proves that
        # every other key reaches the code it names)
        "data.reward_fn_key (rewards are chosen by data_source)": cfg.data.reward_fn_key != "data_source",
        "actor.optim.optimizer=sgd (Adam only)": cfg.actor.optim.optimizer != "adam",
        "critic.optim.optimizer=sgd (Adam only)": cfg.critic.optim.optimizer != "adam",
        "actor.entropy_from_logits_chunk_size (log-probs and entropy use models.logprobs.DEFAULT_CHUNK)":
            cfg.actor.entropy_from_logits_chunk_size != 2048,
        "critic.model.tokenizer_path / ref.model.tokenizer_path / reward.reward_model.model.tokenizer_path (all "
        "roles use the actor's tokenizer)": any(m.tokenizer_path not in (None, cfg.actor.model.tokenizer_path)
                                                for m in (cfg.critic.model, cfg.ref.model, cfg.reward.reward_model.model)),
        "trainer.log_val_generations > 0": cfg.trainer.log_val_generations > 0,
    }
    return [name for name, asked in checks.items() if asked]
