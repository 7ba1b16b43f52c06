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
* Weight sync from training to generation: none for ``rollout.name=megatron`` (the engine decodes with the
  actor's own shards in their training layout). ``rollout.name=vllm``: ``weight_sync_seconds`` below.

Weight sync to vLLM (``vllm_engines``, ``weight_sync_seconds``). The engines: one per node an actor DP replica
spans, over that replica's GPUs on the node (``engine_tp x engine_pp`` of them; ``engine_tp`` null = those GPUs /
``engine_pp``), each holding the whole model; Ray fills nodes in rank order, so node = rank // gpus_per_node. Its
owner is the tp0 rank of the replica's last stage on that node. ``B`` = the model's HF bytes, ``S_s`` = stage
``s``'s, ``n`` = an engine's GPUs. Per step, phases one bucket at a time and never overlapped, so the time is the
sum of the terms, each the worst GPU's:

* ``gather`` (both transports): every parameter gathered over TP to its stage's tp0 only: tp0 receives
  ``(t-1)/t S_s`` over NVLink (TP groups sit inside a node).
* ``weight_transport=ipc``: ``relay``: each stage's tp0 sends its ``S_s`` to every other owner of its replica and
  an owner receives every stage it does not hold, ``B - S_own``: ``max(sent, received)`` per link (full duplex),
  the network (``inter_node_gbs``, one NIC per GPU) to owners on other nodes plus NVLink inside one; ``ipc``: the
  engine's workers read their ``1/n`` shard of each bucket from the owner's GPU (CUDA IPC, P2P over NVLink): the
  owner serves ``(n-1)/n B``; ``hbm``: the owner packs the model into buckets, one read + one write of ``B`` at
  ``hbm_tbps``.
* ``weight_transport=file``: ``d2h``: each stage's tp0 copies ``S_s`` to the host over PCIe (``pcie_gbs``);
  ``write``: ``S_s`` into ``weights_dir``; ``read``: each engine reads ``B`` back; ``h2d``: each worker copies its
  ``B/n`` over its PCIe link. File bandwidth per stream is an assumption (``Hardware.tmpfs_gbs`` for /dev/shm,
  ``shared_fs_gbs`` otherwise: a replica across nodes needs a shared directory); concurrent streams on one node or
  one file system are not divided (the aggregate ``engines x B`` read per step is printed to set against the file
  system's own).
* Extra GPU memory on a writer / owner during the sync: one bucket, + the largest single tensor when it exceeds
  the bucket (a tensor larger than a bucket travels alone).

Bandwidth only, peak link rates, as above: a lower bound. Latency per bucket and vLLM's ``load_weights`` bookkeeping
are not counted. Not in the sync but per step too (``sleep_wake_seconds``): the engine's sleep (level 1: its
``B/n`` weights to pinned host memory) and wake-up (back), over PCIe.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan.memory import Hardware, Layout, layer_params


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


def hf_stage_bytes(arch: ModelArch, pp: int, e: int) -> list[int]:
    """Bytes of each pipeline stage's weights as the sync exports them (HF names, TP-gathered, the vocabulary
    padding dropped, tied embeddings once): they add up to ``arch.num_parameters() x e``."""
    layers = arch.num_layers // pp
    emb = arch.vocab_size * arch.hidden_size
    out = []
    for s in range(pp):
        n = layers * layer_params(arch, 1)
        n += emb if s == 0 else 0
        if s == pp - 1:
            n += arch.hidden_size + (0 if arch.tie_word_embeddings else emb)
        out.append(n * e)
    return out


def largest_tensor_bytes(arch: ModelArch, e: int) -> int:
    """The largest single tensor a sync moves: the embedding / LM head, or a layer's fused (gathered) QKV or fc1."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    qkv = (q + 2 * arch.num_query_groups * arch.head_dim) * h
    fc1 = (2 if arch.activation == "swiglu" else 1) * arch.ffn_hidden_size * h
    return max(arch.vocab_size * h, qkv, fc1, q * h) * e


@dataclass(frozen=True)
class Engine:
    """One vLLM engine: actor DP replica ``replica``'s GPUs on ``node``, holding the stages ``stages`` there; the
    tp0 rank of ``stages[-1]`` (the highest there, as rollout/vllm_layout.py picks) owns it: its buckets feed it."""
    replica: int
    node: int
    stages: tuple[int, ...]
    tp: int
    pp: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


def vllm_engines(layout: Layout, gpus_per_node: int, engine_tp: int | None = None,
                 engine_pp: int = 1) -> list[Engine]:
    """An engine per node each actor DP replica spans, over the replica's GPUs there (Megatron's rank order
    ``tp + TP*dp + TP*DP*pp``, nodes filled in rank order). ValueError, with the numbers, where the engine's
    TP x PP is not the replica's GPUs on a node (the driver's preflight refuses it) or a TP group spans nodes."""
    t, d = layout.tp, layout.dp
    if t > gpus_per_node or gpus_per_node % t:
        raise ValueError(f"actor TP{t} does not fit whole in a node of {gpus_per_node} GPUs: a TP group would "
                         "span nodes")
    engines = []
    for r in range(d):
        nodes: dict[int, list[int]] = {}
        for s in range(layout.pp):
            nodes.setdefault((t * r + t * d * s) // gpus_per_node, []).append(s)
        for node, stages in sorted(nodes.items()):
            gpus = t * len(stages)
            etp = engine_tp if engine_tp is not None else gpus // engine_pp
            if etp * engine_pp != gpus:
                raise ValueError(f"rollout.vllm: tensor_model_parallel_size {etp} x pipeline_model_parallel_size "
                                 f"{engine_pp} = {etp * engine_pp} GPUs, but actor replica {r} holds {gpus} GPUs on "
                                 f"node {node} (TP{t} x {len(stages)} stage(s))")
            engines.append(Engine(r, node, tuple(stages), etp, engine_pp))
    return engines


def weight_sync_seconds(arch: ModelArch, layout: Layout, engines: list[Engine], gpus_per_node: int, hw: Hardware,
                        transport: str, bucket_bytes: int, e: int, shared_fs: bool = False) -> dict:
    """One step's weight sync to the engines (the module's formula): ``terms`` in seconds (their sum is
    ``total``), the bytes per GPU behind each (``bytes``, the worst GPU's), ``extra_gpu_bytes`` held during it."""
    if transport not in ("ipc", "file"):
        raise ValueError(f"weight_sync_seconds: transport {transport!r} is not ipc or file")
    t, d = layout.tp, layout.dp
    stage = hf_stage_bytes(arch, layout.pp, e)
    model = sum(stage)
    node_of = {(r, s): (t * r + t * d * s) // gpus_per_node for r in range(d) for s in range(layout.pp)}
    nv, net, pcie = hw.intra_node_gbs * 1e9, hw.inter_node_gbs * 1e9, hw.pcie_gbs * 1e9
    volume = {"gather": (t - 1) / t * max(stage)}
    terms = {"gather": volume["gather"] / nv}
    n = max(en.gpus for en in engines)
    if transport == "ipc":
        owners = {(en.replica, en.stages[-1]): en for en in engines}
        worst, worst_bytes = 0.0, {"relay_network": 0.0, "relay_nvlink": 0.0}
        for (r, s), node in node_of.items():  # every stage's tp0 GPU
            out = {"net": 0.0, "nv": 0.0}
            into = {"net": 0.0, "nv": 0.0}
            for (r2, s2), en in owners.items():
                if r2 == r and s2 != s:
                    out["net" if en.node != node else "nv"] += stage[s]
            own = owners.get((r, s))
            if own is not None:
                for s2 in range(layout.pp):
                    if s2 != s:
                        into["net" if node_of[(r, s2)] != node else "nv"] += stage[s2]
            link = {k: max(out[k], into[k]) for k in out}
            sec = link["net"] / net + link["nv"] / nv
            if sec >= worst:
                worst, worst_bytes = sec, {"relay_network": link["net"], "relay_nvlink": link["nv"]}
        volume.update(worst_bytes)
        volume["ipc"] = (n - 1) / n * model
        volume["hbm"] = 2 * model
        terms.update(relay=worst, ipc=volume["ipc"] / nv, hbm=volume["hbm"] / (hw.hbm_tbps * 1e12))
    else:
        fs = (hw.shared_fs_gbs if shared_fs else hw.tmpfs_gbs) * 1e9
        volume.update(d2h=max(stage), write=max(stage), read=model, h2d=model / min(en.gpus for en in engines))
        terms.update(d2h=volume["d2h"] / pcie, write=volume["write"] / fs, read=volume["read"] / fs,
                     h2d=volume["h2d"] / pcie)
    big = largest_tensor_bytes(arch, e)
    return {"terms": terms, "total": sum(terms.values()), "bytes": volume, "model_bytes": model,
            "extra_gpu_bytes": bucket_bytes + (big if big > bucket_bytes else 0)}


def sleep_wake_seconds(model_bytes: int, engine_gpus: int, hw: Hardware) -> float:
    """Per step, outside the sync: vLLM sleep level 1 moves an engine GPU's ``B/n`` weights to pinned host memory
    after the rollout and back at wake-up, over PCIe."""
    return 2 * model_bytes / engine_gpus / (hw.pcie_gbs * 1e9)


ASSUMPTIONS = ("bandwidth only (no latency), ring collectives; TP and PP added to the compute (not overlapped); DP "
               "added x (1 - dp_overlap)")

__all__ = ["ring_factor", "spans_nodes", "bandwidth", "tp_seconds", "pp_seconds", "dp_seconds", "generate_seconds",
           "Engine", "vllm_engines", "hf_stage_bytes", "largest_tensor_bytes", "weight_sync_seconds",
           "sleep_wake_seconds", "ASSUMPTIONS"]
