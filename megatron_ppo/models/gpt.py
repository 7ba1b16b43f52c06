"""Model providers: a megatron-core GPTModel for the actor, ref, critic and reward roles (megatron_ppo/roles.py).

* actor: the LM head (vocab-parallel logits).
* ref: the actor architecture, frozen (``requires_grad=False``, eval mode).
* critic: ``output_layer`` replaced by a scalar ``ValueHead`` -> one value per token.
* reward: the critic's architecture; the score of a sequence is the value at its last token (``reward_scores``).

Each call builds the current pipeline stage (pre/post process from megatron's parallel_state). The model is
megatron's GPTModel plus one keyword, ``logit_positions`` (see ``_gpt_model_class``): the actor's and ref's
log-probs only read the positions that predict response tokens, so the LM head runs only there.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.models.fusions import fusion_settings, grad_accum_fusion_available
from megatron_ppo.models.layers import ValueHead
from megatron_ppo.models.spec import decoder_block_spec, resolve_transformer_impl
from megatron_ppo.parallel.platform import cpu_platform_enabled, cpu_platform_needed

logger = logging.getLogger(__name__)



@functools.cache
def _gpt_model_class():
    """megatron's GPTModel whose forward also takes ``logit_positions`` (built lazily: megatron imports are heavy).

    ``logit_positions``: long [N], indices into the flattened (b-major) [B * S] input: the last stage runs the
    output layer only on those positions' final hidden states and returns logits [1, N, V/TP] instead of
    [B, S, V/TP]. For packed PPO micro-batches ~2/3 of the tokens are prompt, whose logits nothing reads; the LM
    head (hidden x vocab, a fifth of a small model's FLOPs) and the vocab-wide log-softmax were spent on them.
    None (the default): megatron's forward, unchanged (generation, value heads, callers without positions)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    class PPOGPTModel(GPTModel):
        _logit_positions = None

        def forward(self, *args, logit_positions: torch.Tensor | None = None, **kwargs):
            if logit_positions is None:
                return super().forward(*args, **kwargs)
            for key in ("labels", "inference_context", "inference_params"):
                if kwargs.get(key) is not None:
                    raise ValueError(f"logit_positions cannot be combined with {key}")
            if self.config.mtp_num_layers:
                raise ValueError("logit_positions is not supported with multi-token prediction (mtp_num_layers)")
            if logit_positions.dim() != 1:
                raise ValueError(f"logit_positions must be 1-D [N], got shape {tuple(logit_positions.shape)}")
            self._logit_positions = logit_positions  # read by _postprocess (megatron's forward calls it)
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._logit_positions = None

        def _preprocess(self, *args, **kwargs):
            """megatron's, then for ``PackedSequences`` (the local spec's packed micro-batches) the rotary table
            gathered once per forward at each token's position in its sequence, [T, 1, dim]: every layer's
            attention applies it elementwise (``PackedSequences`` leaves megatron's cu_seqlens unset, so no THD
            RoPE runs, which would read cu_seqlens back and loop over the sequences in every layer)."""
            from megatron_ppo.models.forward import PackedSequences

            out = super()._preprocess(*args, **kwargs)
            psp = kwargs.get("packed_seq_params")
            if not isinstance(psp, PackedSequences) or out[1] is None:
                return out
            if self.position_embedding_type != "rope":
                raise ValueError(f"packed micro-batches with position_embedding_type={self.position_embedding_type!r}"
                                 " need megatron's PackedSeqParams (models.forward.packed_seq_params)")
            table = out[1]  # [max_seqlen, 1, 1, dim]
            per_token = table.index_select(0, psp.positions.to(table.device)).view(-1, 1, table.shape[-1])
            return (out[0], per_token) + tuple(out[2:])

        def _postprocess(self, hidden_states, *args, **kwargs):
            if self._logit_positions is None or not self.post_process:
                return super()._postprocess(hidden_states, *args, **kwargs)
            return self._logits_at(hidden_states, self._logit_positions)

        def _logits_at(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            """Final hidden [S(/TP under SP), B, H] -> logits [1, N, V/TP] at the flat b-major ``positions``.

            Under sequence parallelism the hidden states are split over the sequence: all-gather them first (as
            megatron's own output layer does, which then must not gather again); the backward of that gather
            only splits, because the output layer's input-gradient all-reduce (non-SP mode) already sums the
            vocab shards' contributions."""
            layer = self.output_layer
            sequence_parallel = layer.sequence_parallel
            if sequence_parallel:
                hidden_states = gather_from_sequence_parallel_region(
                    hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp)
            s, b, h = hidden_states.shape
            flat = hidden_states.transpose(0, 1).reshape(b * s, h)
            selected = flat.index_select(0, positions.to(flat.device)).unsqueeze(1)  # [N, 1, H]
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            layer.sequence_parallel = False  # (megatron's inference path does the same around its own gather)
            try:
                logits, _ = layer(selected, weight=weight)
            finally:
                layer.sequence_parallel = sequence_parallel
            return logits.transpose(0, 1)  # [1, N, V/TP]

    return PPOGPTModel


def _recompute_kwargs(recompute) -> dict:
    """None | "full" | "selective" | dict(granularity, method, num_layers, modules) -> TransformerConfig kwargs."""
    if recompute in (None, False, "none", ""):
        return {}
    if recompute == "full":
        recompute = {"granularity": "full"}
    elif recompute == "selective":
        recompute = {"granularity": "selective"}
    if not isinstance(recompute, dict):
        raise ValueError(f"recompute must be None, 'full', 'selective' or a dict, got {recompute!r}")
    unknown = set(recompute) - {"granularity", "method", "num_layers", "modules"}
    if unknown:
        raise ValueError(f"recompute: unknown keys {sorted(unknown)} (granularity, method, num_layers, modules)")
    granularity = recompute.get("granularity")
    if granularity not in ("full", "selective"):
        raise ValueError(f"recompute.granularity must be 'full' or 'selective', got {granularity!r}")
    out = {"recompute_granularity": granularity}
    if granularity == "full":
        out["recompute_method"] = recompute.get("method", "uniform")
        out["recompute_num_layers"] = recompute.get("num_layers", 1)
    elif "modules" in recompute:
        out["recompute_modules"] = list(recompute["modules"])
    return out


def transformer_config(
    arch: ModelArch,
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute=None,
    transformer_impl: str = "auto",
    **overrides,
):
    """megatron TransformerConfig for ``arch`` at the current parallel layout (TP/PP from parallel_state)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if sequence_parallel and tp == 1:
        logger.info("sequence_parallel requested with TP=1: disabled (it needs TP > 1)")
        sequence_parallel = False
    for name, count in (("num_attention_heads", arch.num_attention_heads), ("num_query_groups", arch.num_query_groups)):
        if count % tp:
            raise ValueError(f"{name}={count} is not divisible by tensor parallel size {tp}")
    if arch.ffn_hidden_size % tp:
        raise ValueError(f"ffn_hidden_size={arch.ffn_hidden_size} is not divisible by tensor parallel size {tp}")
    if arch.num_layers % pp:
        raise ValueError(f"num_layers={arch.num_layers} is not divisible by pipeline parallel size {pp}")
    on_cpu = cpu_platform_needed()
    if on_cpu and params_dtype not in (torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"params_dtype={params_dtype} is not supported on CPU")
    impl = resolve_transformer_impl(transformer_impl, params_dtype)
    activation = {"swiglu": F.silu, "silu": F.silu, "gelu": F.gelu}[arch.activation]
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization=arch.normalization,
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=arch.activation == "swiglu",
        activation_func=activation,
        add_bias_linear=False,
        add_qkv_bias=arch.add_qkv_bias,
        hidden_dropout=arch.hidden_dropout,
        attention_dropout=arch.attention_dropout,
        init_method_std=arch.init_method_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        # Fused kernels where their library is present on a GPU, none on the CPU (models/fusions.py).
        **fusion_settings("transformer_engine" if impl == "transformer_engine" else "local", not on_cpu,
                          arch.activation, arch.activation == "swiglu", False, grad_accum_fusion_available()),
        # Micro-batches of dynamic size (packed, token-budget batches) through the pipeline schedules.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # (dense model; megatron rejects variable lengths with 'allgather')
        transformer_impl="transformer_engine" if impl == "transformer_engine" else "local",
    )
    kwargs.update(_recompute_kwargs(recompute))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _apply_rope_scaling(model, arch: ModelArch) -> None:
    """Megatron hard-codes llama3 scaling's low/high frequency factors and original length: use the arch's."""
    rope = arch.rope_config()
    if rope["rope_type"] != "llama3" or not hasattr(model, "rotary_pos_emb"):
        return
    emb = model.rotary_pos_emb
    dim = arch.head_dim
    base = 1.0 / (arch.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=emb.inv_freq.device) / dim))
    emb.inv_freq = emb._apply_scaling(base, factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                                      high_freq_factor=rope["high_freq_factor"],
                                      original_max_position_embeddings=rope["original_max_position_embeddings"])


def build_gpt_model(
    arch: ModelArch,
    role: str = "actor",
    *,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute=None,
    transformer_impl: str = "auto",
    value_head_bias: bool = False,
    config_overrides: dict | None = None,
):
    """Build the GPTModel stage of ``role`` for this rank (needs ``megatron_ppo.parallel.initialize`` first, in
    this thread: it sets up the CPU platform layer on a CUDA-less torch; building a model never does).

    A value role (roles.py: critic, reward): ``output_layer`` is a ``ValueHead`` ([b, s, 1] fp32 values) and
    embeddings are never tied. A frozen role (ref, reward): no gradients, eval mode. The model carries ``.arch``
    and ``.role``; an LM role's forward (actor, ref) takes ``logit_positions`` (``_gpt_model_class``).
    """
    from megatron.core import parallel_state

    from megatron_ppo import roles

    role_spec = roles.spec(role)  # ValueError naming the roles
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model: call megatron_ppo.parallel.initialize() first")
    if cpu_platform_needed() and not cpu_platform_enabled():  # set up by parallel.initialize, never here
        raise RuntimeError("build_gpt_model: torch has no CUDA and the CPU platform layer is not active in this "
                           "thread; build the model in the thread that called megatron_ppo.parallel.initialize() "
                           "(or call megatron_ppo.parallel.platform.enable_cpu_platform() in this one)")
    config = transformer_config(arch, params_dtype=params_dtype, sequence_parallel=sequence_parallel,
                                recompute=recompute, transformer_impl=transformer_impl, **(config_overrides or {}))
    tp = config.tensor_model_parallel_size
    rope = arch.rope_config()
    pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    is_value_model = role_spec.value_model
    model = _gpt_model_class()(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, transformer_impl),
        vocab_size=arch.padded_vocab_size(tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not is_value_model,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rotary_base,
        rope_scaling=rope["rope_type"] == "llama3",
        rope_scaling_factor=rope.get("factor", 8.0),
        seq_len_interpolation_factor=rope["factor"] if rope["rope_type"] == "linear" else None,
    )
    _apply_rope_scaling(model, arch)
    if is_value_model and post_process:
        model.output_layer = ValueHead(config, arch.hidden_size, bias=value_head_bias)
    if not cpu_platform_needed():
        model.cuda(torch.cuda.current_device())
    model.arch = arch
    model.role = role
    if not role_spec.trainable:  # frozen: no gradients, never trained
        model.requires_grad_(False)
        model.eval()
    return model


def reward_scores(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score per sequence: the value at the last response token. values, mask: [B, S] -> [B].

    A row with an empty response scores 0 (and is reported by the caller, not silently used)."""
    if values.shape != response_mask.shape:
        raise ValueError(f"reward_scores: values {tuple(values.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} differ in shape")
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    scores = values.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(last >= 0, scores, torch.zeros_like(scores))
