"""Megatron-LM's own theoretical memory formula, rewritten here to check the planner's memory model against it.

Source: NVIDIA/Megatron-LM ``megatron/training/theoretical_memory_usage.py`` at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22; the file last changed in
1bcb3b9e0b029c6109d8d32872645bd540052963):
``compute_weight_and_optimizer_memory``, ``compute_activation_memory`` (sequence parallel + selective recompute,
Korthikanti et al. 2022 Table 2), ``compute_activation_memory_without_sp`` and the branch ``report_theoretical_memory``
takes between them. Only the dense-transformer path (no MoE, no MTP, no multi-latent attention, no interleaved
pipeline), which is what the planner models; the arithmetic and its order are Megatron's, in bytes.

It lives in plan/ rather than in the tests because two users need it: tests/unit/test_plan_megatron_formula.py
(agreement and the documented differences) and tools/bench_plan_vs_published.py (the table in
docs/bench/scaling.md). Nothing in the planner itself calls it.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan.memory import Layout

SOURCE = ("NVIDIA/Megatron-LM megatron/training/theoretical_memory_usage.py @ "
          "d98e8a64ddf34856e74b24714e3bedb2f5a39553")


@dataclass(frozen=True)
class MegatronArgs:
    """The subset of Megatron-LM's ``args`` the dense path of the formula reads."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    padded_vocab_size: int
    swiglu: bool
    normalization: str
    untie_embeddings_and_output_weights: bool
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    use_distributed_optimizer: bool
    sequence_parallel: bool
    recompute_granularity: str | None
    seq_length: int
    micro_batch_size: int
    group_query_attention: bool = True


def megatron_args(arch: ModelArch, layout: Layout, seq_length: int, micro_batch_size: int) -> MegatronArgs:
    """The args Megatron-LM would get for this arch and layout (vocabulary padded as Megatron pads it)."""
    return MegatronArgs(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim, padded_vocab_size=arch.padded_vocab_size(layout.tp),
        swiglu=arch.activation == "swiglu", normalization=arch.normalization,
        untie_embeddings_and_output_weights=not arch.tie_word_embeddings,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        data_parallel_size=layout.dp, use_distributed_optimizer=layout.distributed_optimizer,
        sequence_parallel=layout.sp, recompute_granularity=None if layout.recompute == "none" else layout.recompute,
        seq_length=seq_length, micro_batch_size=micro_batch_size)


def compute_weight_and_optimizer_memory(args: MegatronArgs) -> float:
    """Bytes of weights + gradients + optimizer on the most loaded shard: parameters x 18, or x (6 + 12/DP) with
    the distributed optimizer (bf16 params, fp32 grads, fp32 main params and Adam states)."""
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = query_projection_size / args.hidden_size
    num_query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1
    norm_size = 1 if args.normalization == "RMSNorm" else 2
    self_attn_term = (2 * args.hidden_size * args.hidden_size
                      * ((1 + (num_query_groups / args.num_attention_heads)) * query_projection_to_hidden_size_ratio))
    embedding_size = args.hidden_size * args.padded_vocab_size
    final_layernorm = norm_size * args.hidden_size
    attention_params = self_attn_term
    dense_mlp_params = 2 * args.hidden_size * args.ffn_hidden_size * gated_linear_multiplier
    layernorm_params = 2 * args.hidden_size * norm_size
    num_dense_layers = args.num_layers
    tp_sharded_params_in_transformer_block = (attention_params + dense_mlp_params) * num_dense_layers
    replicated_params_in_transformer_block = layernorm_params * num_dense_layers + final_layernorm
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    # Most loaded model shard has 1/pp_size transformer layers and 1 embedding layer.
    tp_sharded_params_on_most_loaded_shard = (tp_sharded_params_in_transformer_block / pp + embedding_size) / tp
    replicated_params_on_most_loaded_shard = replicated_params_in_transformer_block / pp
    if args.untie_embeddings_and_output_weights and pp == 1:
        tp_sharded_params_on_most_loaded_shard += embedding_size / tp
    bytes_per_parameter = 18 if not args.use_distributed_optimizer else 6 + (12 / args.data_parallel_size)
    return (tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard) * bytes_per_parameter


def compute_activation_memory(args: MegatronArgs, num_microbatches: int | None) -> float:
    """Sequence parallel + selective recompute (Korthikanti Table 2): first pipeline stage, bytes."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    pp = args.pipeline_model_parallel_size
    activation_memory = (s * b * h) * (18 + (4 * (args.ffn_hidden_size / h)))
    activation_memory *= args.num_layers
    activation_memory += 8 * s * b * pp  # input to embedding (pp micro-batches in flight)
    activation_memory += s * b * h * pp  # dropout in embedding layer
    if pp > 1 and num_microbatches is not None:
        activation_memory *= min(1, num_microbatches / pp)
    if pp == 1:  # inputs to output layer and CE loss
        activation_memory += s * b * h * 4 * (1 + (args.padded_vocab_size / h))
    return activation_memory / args.tensor_model_parallel_size


def compute_activation_memory_without_sp(args: MegatronArgs, num_microbatches: int | None) -> float:
    """Without sequence parallelism (every other case ``report_theoretical_memory`` meets), bytes."""
    s, b, h, t = args.seq_length, args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    per_layer_memory = s * b * h * (10 + (24 / t))
    total_activation_memory = per_layer_memory * args.num_layers
    total_activation_memory += 8 * s * b * pp
    total_activation_memory += s * b * h * pp
    if pp > 1 and num_microbatches is not None:
        total_activation_memory *= min(1, num_microbatches / pp)
    if pp == 1:
        logits_size = s * b * args.padded_vocab_size / t
        final_ln_output = s * b * h
        total_activation_memory += (logits_size + final_ln_output) * 2
    overhead_factor = 1.05  # optimizer and miscellaneous temporaries
    return total_activation_memory * overhead_factor


def report_theoretical_memory(args: MegatronArgs, num_microbatches: int | None = None) -> dict:
    """Megatron's report in bytes: {"weight_and_optimizer", "activation", "total", "branch"}; the SP formula only
    with sequence parallel and selective recompute, the no-SP formula otherwise (full recompute included: the
    formula has no full-recompute case)."""
    weights = compute_weight_and_optimizer_memory(args)
    if args.sequence_parallel and args.recompute_granularity == "selective":
        act, branch = compute_activation_memory(args, num_microbatches), "sp+selective"
    else:
        act, branch = compute_activation_memory_without_sp(args, num_microbatches), "without_sp"
    return {"weight_and_optimizer": weights, "activation": act, "total": weights + act, "branch": branch}


def documented_activation_delta(arch: ModelArch, seq: int, micro: int, layout: Layout, in_flight: int) -> float:
    """Megatron's SP+selective activation bytes minus the planner's ``activations`` for the same layout (the planner
    at selective recompute, flash attention, bf16), term by term:

    * per layer (``s b`` tokens, / TP): Megatron's GPT layer keeps two 1-byte dropout masks (``+2 s b h``) and full
      ``h``-wide K and V (``+4 s b h (1 - g/a)`` against GQA's ``g/a``), and a GeLU MLP's two ``f``-wide tensors
      where SwiGLU keeps three (``-2 s b f``);
    * the embedding's input ids and dropout mask (``8 s b PP + s b h PP``), scaled like the layers;
    * at PP = 1 the output layer's input and fp32 logits (``4 s b h (1 + V/h)``), which the planner shows in its
      separate ``logits`` column instead (``s b V/t (e + 4)``, at every PP: the last stage's, added to the first
      stage's activations).
    """
    h, f, a, g = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads, arch.num_query_groups
    t, pp = layout.tp, layout.pp
    sb = seq * micro
    layers_in_flight = arch.num_layers // pp * in_flight
    per_layer = sb * (2 * h + 4 * h * (1 - g / a) - 2 * f)
    embedding = (8 * sb * pp + sb * h * pp) * min(1, in_flight / pp)
    output = sb * h * 4 * (1 + arch.padded_vocab_size(t) / h) if pp == 1 else 0
    return (per_layer * layers_in_flight + embedding + output) / t


__all__ = ["SOURCE", "MegatronArgs", "megatron_args", "compute_weight_and_optimizer_memory",
           "compute_activation_memory", "compute_activation_memory_without_sp", "report_theoretical_memory",
           "documented_activation_delta"]
