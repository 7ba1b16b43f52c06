"""Communication time of one PPO phase: pure functions of (ModelArch, Layout, tokens, Hardware), in seconds.

Why: at 8-way TP, 4 pipeline stages and DP across nodes the links, not the FLOPs, decide part of the step; a
layout that looks free in FLOPs (TP16 across two nodes, DP over InfiniBand) pays here. The model is bandwidth
only: ``bytes moved per GPU / link bandwidth``; collectives are rings (NCCL's algorithm for large messages), so a
rank moves ``2 (n-1)/n`` of the message in an all-reduce and ``(n-1)/n`` in an all-gather or a reduce-scatter
(Patarasuk & Yuan 2009; the "bus bandwidth" of nccl-tests' PERFORMANCE.md). Latency (tens of microseconds per
collective) is not modelled: it matters for decode's small messages, so ``generate``'s comm is a lower bound.

The links (``Hardware``): a group whose ranks all sit in one node uses NVLink (``intra_node_gbs``), else the
inter-node network (``inter_node_gbs``, per GPU: DGX H100 has one 400 Gb/s NIC per GPU). Megatron numbers ranks
TP first, then DP, then PP (``rank = tp + TP*dp + TP*DP*pp``, docs/distributed.md), so a TP group is TP
consecutive ranks, a DP group spans TP*DP consecutive ranks, and a pipeline spans all TP*DP*PP ranks of a layout.

The terms, per GPU, for ``tokens`` = the tokens one DP replica processes in the phase (``e`` = dtype bytes, ``h`` =
hidden size, ``t, p, d`` = TP, PP, DP):

* TP (Megatron: Shoeybi et al. 2019 fig. 4; with SP Korthikanti et al. 2022 sec. 4.2.2): per layer and micro-batch two
  all-reduces of the ``s b h e`` activation in the forward pass (after attention's and the MLP's row-parallel
  linears) and two in the backward pass (the column-parallel inputs' gradients); with sequence parallelism each
  is an all-gather + a reduce-scatter, the same bytes. Full recompute runs the forward's collectives again. A stage
  holds ``L/p`` layers: ``passes x 2 x (L/p) x tokens x h x e x 2(t-1)/t / bw_tp``.
* PP (Megatron's 1F1B p2p): per micro-batch and stage boundary the activation ``s b h e`` goes forward and its
  gradient backward (forward-only phases: forward only); with sequence parallelism each TP rank sends its
  ``1/t`` slice. ``messages x (1 + (p-1)/m)``: the pipeline's fill and drain, as the compute's bubble.
* DP (Megatron DDP, ``grad_reduce_in_fp32``): once per optimizer step the gradient buffer (``grad_bytes`` per
  parameter) is reduce-scattered and the updated bf16 parameters all-gathered with the distributed optimizer, or
  the gradients all-reduced without it; ``(1 - dp_overlap)`` of it is on the critical path.
* TP and PP are added to the compute (not overlapped: Megatron overlaps them only with TE's userbuffers /
  interleaved schedules, which this driver does not use). DP is added too unless ``Hardware.dp_overlap`` says
  which fraction the backward pass hides (Megatron's ``overlap_grad_reduce``; 0 here because
  ``models/training.wrap_ddp`` is called without it).
* Weight sync from training to generation: none to model for ``rollout.name=megatron`` (the engine decodes with
  the actor's own shards in their training layout); ``rollout.name=vllm`` (a copy resharded to vLLM's TP through
  files or IPC) is not modelled, and the planner says so.
"""
from __future__ import annotations

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan.memory import Hardware, Layout


def ring_factor(collective: str, n: int) -> float:
    """The fraction of the message one rank sends (and receives) in a ring ``collective`` over ``n`` ranks."""
    if n < 1:
        raise ValueError(f"ring_factor: n must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"ring_factor: unknown collective {collective!r}")


def spans_nodes(ranks: int, gpus_per_node: int) -> bool:
    """Whether a block of ``ranks`` consecutive ranks (Megatron's order) crosses a node boundary."""
    return ranks > gpus_per_node or gpus_per_node % ranks != 0


def bandwidth(ranks: int, gpus_per_node: int, hw: Hardware) -> float:
    """Bytes/s per GPU of a group laid out in ``ranks`` consecutive ranks: NVLink inside a node, else the network
    (a ring over nodes runs at its slowest hop)."""
    gbs = hw.inter_node_gbs if spans_nodes(ranks, gpus_per_node) else hw.intra_node_gbs
    return gbs * 1e9


def tp_seconds(arch: ModelArch, layout: Layout, tokens: float, passes: int, micro_batches: int, e: int,
               hw: Hardware, gpus_per_node: int) -> float:
    """TP collectives of one stage for ``tokens`` (one DP replica's) over ``passes`` passes (1 forward only, 2
    forward + backward, 3 with full recompute), stretched by the pipeline bubble like the compute."""
    if layout.tp == 1:
        return 0.0
    per_pass = 2 * (arch.num_layers // layout.pp) * tokens * arch.hidden_size * e
    bubble = 1 + (layout.pp - 1) / max(1, micro_batches)
    return passes * per_pass * ring_factor("all_reduce", layout.tp) / bandwidth(layout.tp, gpus_per_node, hw) * bubble


def pp_seconds(arch: ModelArch, layout: Layout, tokens: float, micro_tokens: float, directions: int,
               micro_batches: int, e: int, hw: Hardware, gpus_per_node: int) -> float:
    """Point-to-point activations (and, ``directions=2``, their gradients) between stages: one message of
    ``micro_tokens x h x e`` (/ TP with sequence parallelism) per micro-batch and direction, plus the fill/drain."""
    if layout.pp == 1:
        return 0.0
    message = micro_tokens * arch.hidden_size * e / (layout.tp if layout.sp else 1)
    messages = tokens / micro_tokens * directions * (1 + (layout.pp - 1) / max(1, micro_batches))
    return messages * message / bandwidth(layout.ranks, gpus_per_node, hw)


def dp_seconds(params: int, layout: Layout, optimizer_steps: int, param_bytes: int, grad_bytes: int, hw: Hardware,
               gpus_per_node: int) -> float:
    """Gradient reduction (+ parameter all-gather with the distributed optimizer) of the rank's ``params`` once per
    optimizer step, the part ``hw.dp_overlap`` does not hide."""
    if layout.dp == 1 or not optimizer_steps:
        return 0.0
    if layout.distributed_optimizer:
        volume = params * (grad_bytes * ring_factor("reduce_scatter", layout.dp)
                           + param_bytes * ring_factor("all_gather", layout.dp))
    else:
        volume = params * grad_bytes * ring_factor("all_reduce", layout.dp)
    bw = bandwidth(layout.tp * layout.dp, gpus_per_node, hw)
    return optimizer_steps * volume / bw * (1 - hw.dp_overlap)


def generate_seconds(arch: ModelArch, layout: Layout, tokens: float, e: int, hw: Hardware,
                     gpus_per_node: int) -> dict[str, float]:
    """Generation of ``tokens`` (prompt + response tokens of one DP replica's sequences) with the actor's layout:
    two TP all-reduces per layer and token, and one p2p message per stage boundary and token; the stages decode
    one after the other, so every layer and boundary counts. Bandwidth only (see the module): a lower bound."""
    tp = 0.0
    if layout.tp > 1:
        tp = (2 * arch.num_layers * tokens * arch.hidden_size * e * ring_factor("all_reduce", layout.tp)
              / bandwidth(layout.tp, gpus_per_node, hw))
    pp = 0.0
    if layout.pp > 1:
        pp = (layout.pp - 1) * tokens * arch.hidden_size * e / bandwidth(layout.ranks, gpus_per_node, hw)
    return {"tp": tp, "pp": pp, "dp": 0.0}


ASSUMPTIONS = ("bandwidth only (no latency), ring collectives; TP and PP added to the compute (not overlapped); DP "
               "added x (1 - dp_overlap)")

__all__ = ["ring_factor", "spans_nodes", "bandwidth", "tp_seconds", "pp_seconds", "dp_seconds", "generate_seconds",
           "ASSUMPTIONS"]
