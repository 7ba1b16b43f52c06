"""Per-GPU memory and FLOPs of one role's model shard: pure functions of (ModelArch, layout, batch shape).

Why a model and not a trial run: a 70B layout must be chosen before the hundreds of GPUs are booked. The terms:

* parameters per rank: Megatron's GPTModel split (column/row-parallel linears / TP, norms replicated, the
  padded vocabulary / TP on the first stage, the LM head on the last stage, a copy of tied embeddings there when
  PP > 1, a replicated ``hidden``-wide value head for the critic);
* weights in the parameter dtype; gradients in the DDP buffer (fp32: ``models.training.wrap_ddp`` reduces in
  fp32); fp32 master weights (only for bf16/fp16 parameters) and Adam's two fp32 moments, divided by DP with the
  distributed optimizer (Megatron-LM's distributed-optimizer guide: bf16 18 -> 6 + 12/DP bytes per parameter);
* activations: Korthikanti et al. 2022 (arXiv 2205.05198) per-layer bytes, written out for a Llama layer
  (SwiGLU, GQA, RMSNorm, no dropout): ``e s b (4h + 2h + 2h g/a + 3f)`` with the first ``4h`` (norm inputs and
  outputs) divided by TP only with sequence parallelism, plus ``e a s^2 b / t`` of softmax output unless the
  attention is flash/fused (selective recompute drops that term); full recompute keeps the layer inputs only and
  one layer's activations for the recomputation; the first pipeline stage holds ``min(PP, micro-batches)``
  micro-batches in flight (1F1B);
* logits: the last stage's ``s b V/t`` in the parameter dtype plus an fp32 log-softmax copy;
* KV cache of generation: ``2 L/PP ceil(g/t) d_head (prompt + response) B e`` for the B sequences a DP replica
  generates at once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from megatron_ppo import roles
from megatron_ppo.models.arch import ModelArch

GIB = 1024 ** 3
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "optimizer")


def _value_model(role: str) -> bool:
    """A value head instead of the LM head (roles.py: critic, reward)."""
    return roles.spec(role).value_model


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of one pipeline stage, split into what the optimizer/DDP treat alike."""
    layers: int          # transformer layers in the stage
    transformer: int     # the stage's layer parameters on this TP rank
    embedding: int       # word embedding rows on this TP rank (first stage; tied copy on the last when PP > 1)
    head: int            # LM head (actor/ref) or value head (critic) on the last stage
    final_norm: int

    @property
    def total(self) -> int:
        return self.transformer + self.embedding + self.head + self.final_norm


def layer_params(arch: ModelArch, tp: int = 1) -> int:
    """One transformer layer's parameters on one TP rank (linears / tp, the two norms replicated)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = 2 * arch.num_query_groups * arch.head_dim
    linear = h * (q + kv) + q * h + h * f * (3 if arch.activation == "swiglu" else 2)
    bias = (q + kv) if arch.add_qkv_bias else 0
    return (linear + bias) // tp + 2 * h


def stage_params(arch: ModelArch, role: str, tp: int = 1, pp: int = 1, stage: int = 0) -> StageParams:
    """Megatron's parameters on one rank of pipeline ``stage`` (vocabulary padded for TP, as build_gpt_model)."""
    if arch.num_layers % pp:
        raise ValueError(f"stage_params: num_layers={arch.num_layers} is not divisible by pp={pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage_params: stage={stage} not in [0, {pp})")
    layers = arch.num_layers // pp
    rows = arch.padded_vocab_size(tp) * arch.hidden_size // tp
    first, last = stage == 0, stage == pp - 1
    critic = _value_model(role)
    tied = arch.tie_word_embeddings and not critic
    embedding = rows if first else 0
    if critic:
        head = arch.hidden_size if last else 0  # ValueHead: one replicated row
    elif tied:
        head = rows if (last and pp > 1) else 0  # Megatron keeps a copy of the shared embedding on the last stage
    else:
        head = rows if last else 0
    return StageParams(layers, layers * layer_params(arch, tp), embedding, head, arch.hidden_size if last else 0)


def total_params(arch: ModelArch, role: str = "actor") -> int:
    """The model's parameters (unpadded vocabulary, tied weights once): the number a model card quotes."""
    n = arch.num_parameters()
    if _value_model(role):
        n += arch.hidden_size - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    return n


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    distributed_optimizer: bool = True
    recompute: str = "none"  # none | selective | full
    offload: str = "none"    # none | optimizer (optimizer states on the host)

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout: recompute={self.recompute!r} not in {RECOMPUTE}")
        if self.offload not in OFFLOAD:
            raise ValueError(f"Layout: offload={self.offload!r} not in {OFFLOAD}")
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        return (f"TP{self.tp} PP{self.pp} DP{self.dp}{' SP' if self.sp else ''} rc={self.recompute}"
                f"{' off=opt' if self.offload != 'none' else ''}")


@dataclass(frozen=True)
class Workload:
    """What one rank of the role processes: sequence length, micro-batch, micro-batches in flight, generation."""
    seq_len: int                 # prompt + response tokens per sequence
    micro_batch: int             # sequences per forward/backward
    micro_batches: int = 1       # micro-batches per optimizer step on one DP rank (pipeline depth bound)
    gen_batch: int = 0           # sequences one DP replica generates at once (actor); 0: no generation
    param_bytes: int = 2         # 2: bf16/fp16, 4: fp32
    grad_bytes: int = 4          # DDP grad buffer (grad_reduce_in_fp32)
    trainable: bool = True
    flash_attention: bool = True  # fused attention keeps no s x s scores


@dataclass
class Memory:
    """Bytes per GPU; ``optimizer`` follows the layout's distributed_optimizer and offload, the other two are shown
    for the comparison the planner prints."""
    params: int
    weights: int
    grads: int
    optimizer: int
    optimizer_replicated: int    # master + Adam moments without the distributed optimizer
    optimizer_distributed: int   # ... with it (/ DP)
    activations: int
    activations_no_recompute: int
    logits: int
    kv_cache: int
    extra: dict = field(default_factory=dict)

    @property
    def resident(self) -> int:
        """Held for the whole run (colocated roles add these up)."""
        return self.weights + self.grads + self.optimizer

    @property
    def transient(self) -> int:
        """The role's largest phase: training (activations + logits) or generation (KV cache + logits row)."""
        return max(self.activations + self.logits, self.kv_cache)

    @property
    def total(self) -> int:
        return self.resident + self.transient

    def as_gib(self) -> dict:
        d = {k: v / GIB for k, v in asdict(self).items() if isinstance(v, int) and k != "params"}
        d.update(resident=self.resident / GIB, transient=self.transient / GIB, total=self.total / GIB)
        return d


def layer_activation_bytes(arch: ModelArch, seq: int, micro: int, tp: int, sp: bool, e: int,
                           recompute: str, flash: bool) -> int:
    """Stored activation bytes of one layer for one micro-batch (Korthikanti et al., Llama terms; see module)."""
    h, f, a, g = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads, arch.num_query_groups
    sb = seq * micro
    replicated = 4 * h * sb * e / (tp if sp else 1)
    sharded = (2 * h + 2 * h * g / a + 3 * f) * sb * e / tp
    scores = 0 if (flash or recompute in ("selective", "full")) else a * seq * seq * micro * e / tp  # softmax out
    return int(replicated + sharded + scores)


def memory(arch: ModelArch, role: str, layout: Layout, work: Workload) -> Memory:
    """Per-GPU memory of ``role`` at ``layout``: the worst pipeline stage (first for activations, the larger of
    first/last for parameters)."""
    stages = {0, layout.pp - 1}
    params = max(stage_params(arch, role, layout.tp, layout.pp, s).total for s in stages)
    e = work.param_bytes
    weights = params * e
    trainable = work.trainable and roles.spec(role).trainable  # a frozen role (roles.py) never has either
    grads = params * work.grad_bytes if trainable else 0
    master = 4 if e < 4 else 0
    opt_rep = params * (master + 8) if trainable else 0
    opt_dist = math.ceil(opt_rep / layout.dp)
    optimizer = 0 if layout.offload == "optimizer" else (opt_dist if layout.distributed_optimizer else opt_rep)

    layers = arch.num_layers // layout.pp
    in_flight = min(layout.pp, max(1, work.micro_batches))
    per_layer = layer_activation_bytes(arch, work.seq_len, work.micro_batch, layout.tp, layout.sp, e, "none",
                                       work.flash_attention)
    no_rc = layers * in_flight * per_layer
    if not trainable:  # forward only, no autograd graph: one layer's activations at a time
        act = per_layer
    elif layout.recompute == "full":
        inputs = work.seq_len * work.micro_batch * arch.hidden_size * e // (layout.tp if layout.sp else 1)
        act = layers * in_flight * inputs + per_layer
    elif layout.recompute == "selective":
        act = layers * in_flight * layer_activation_bytes(arch, work.seq_len, work.micro_batch, layout.tp,
                                                          layout.sp, e, "selective", work.flash_attention)
    else:
        act = no_rc
    if not trainable:
        no_rc = act
    vocab_rows = arch.padded_vocab_size(layout.tp) // layout.tp
    critic = _value_model(role)
    logits = 0 if critic else work.seq_len * work.micro_batch * vocab_rows * (e + 4)
    kv = 0
    if work.gen_batch and not critic:
        kv_heads = math.ceil(arch.num_query_groups / layout.tp)
        kv = 2 * layers * kv_heads * arch.head_dim * work.seq_len * work.gen_batch * e
        kv += work.gen_batch * vocab_rows * (e + 4)  # one decode step's logits
    return Memory(params, weights, grads, optimizer, opt_rep, opt_dist, act, no_rc, logits, kv)


# ---------------------------------------------------------------------------------------------- FLOPs and time

def forward_flops_per_token(arch: ModelArch, seq_len: int) -> float:
    """2 N (matmuls) + causal attention (QK^T and AV over seq_len/2 keys on average): 2 x 2 x L x (s/2) x q."""
    q = arch.num_attention_heads * arch.head_dim
    return 2.0 * arch.num_parameters() + 2.0 * arch.num_layers * seq_len * q


@dataclass(frozen=True)
class Hardware:
    gpu_mem_gib: float = 80.0
    peak_tflops: float = 989.0   # H100/H200 SXM dense bf16
    hbm_tbps: float = 3.35       # H100 SXM; H200: 4.8
    mfu: float = 0.40            # training/forward phases
    headroom_gib: float = 6.0    # per GPU: NCCL buffers, allocator fragmentation (contexts: cuda_context_gib)
    # Per process on a GPU (colocated roles are one process each): the CUDA context and the kernels loaded into it,
    # outside any allocator. nvidia-smi readings of a bare PyTorch process: 781 MB (pytorch/pytorch#34323), ~567 MB
    # for the context alone (#25752); 255 MB with CUDA 12's lazy loading before any kernel ran (#144025), which then
    # loads cuBLAS / NCCL / Megatron kernels as a training step first uses them. 1 GiB: the eager figures rounded
    # up; not measured here (no GPU lent: `torch.cuda.mem_get_info` minus `memory_reserved` per process would).
    cuda_context_gib: float = 1.0
    # Links, GB/s per GPU and direction (plan/comm.py). NVLink 4 of an H100/H200 SXM: 18 links, 900 GB/s both ways
    # together (NVIDIA H100 datasheet), 450 one way. Between nodes: DGX/HGX H100 has one 400 Gb/s InfiniBand NIC
    # (ConnectX-7) per GPU = 50 GB/s. Peak link rates: what NCCL reaches ("bus bandwidth") is lower, so the
    # comm times are lower bounds.
    intra_node_gbs: float = 450.0
    inter_node_gbs: float = 50.0
    dp_overlap: float = 0.0      # share of the DP gradient/parameter collectives hidden behind the backward pass
    #                              (Megatron overlap_grad_reduce); 0: this driver's wrap_ddp does not overlap
    # Weight sync to vLLM (plan/comm.py weight_sync_seconds). Host link of an H100/H200 SXM: PCIe Gen5 x16, 64 GB/s
    # per direction nominal; 50 assumed for pinned copies. File bandwidth per stream, ASSUMPTIONS, not measured: one
    # process's memcpy into or out of /dev/shm's page cache (tmpfs), and one client stream of a parallel file system
    # (Lustre / GPFS / WEKA on a 100-200 Gb/s storage NIC; an NFS mount is slower, 1-2 GB/s).
    pcie_gbs: float = 50.0
    tmpfs_gbs: float = 10.0
    shared_fs_gbs: float = 5.0

    def __post_init__(self):
        if not 0.0 <= self.dp_overlap <= 1.0:
            raise ValueError(f"Hardware: dp_overlap must be in [0, 1], got {self.dp_overlap}")
        for name in ("intra_node_gbs", "inter_node_gbs", "pcie_gbs", "tmpfs_gbs", "shared_fs_gbs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Hardware: {name} must be > 0, got {getattr(self, name)}")
        if self.cuda_context_gib < 0:
            raise ValueError(f"Hardware: cuda_context_gib must be >= 0, got {self.cuda_context_gib}")


def phase_seconds(flops: float, gpus: int, hw: Hardware) -> float:
    return flops / (gpus * hw.peak_tflops * 1e12 * hw.mfu)


def decode_seconds(steps: int, bytes_read_per_gpu: float, hw: Hardware) -> float:
    """Memory-bound decoding: every step reads the rank's weights and KV cache once."""
    return steps * bytes_read_per_gpu / (hw.hbm_tbps * 1e12)


def vllm_engine_bytes(arch: ModelArch, engine_tp: int, engine_pp: int, seq_len: int, seqs: int, e: int) -> dict:
    """Per GPU of a vLLM engine while it generates (asleep, level 1, while the actor trains: weights on the host,
    KV cache freed): the model / (TP x PP), and the KV cache of ``seqs`` sequences of ``seq_len`` (``kv_cache``)
    and of one (``kv_cache_min``: below that vLLM refuses to start). vLLM's activations and CUDA graphs are not
    counted."""
    per_token = 2 * (arch.num_layers // engine_pp) * math.ceil(arch.num_query_groups / engine_tp) * arch.head_dim * e
    return {"weights": arch.num_parameters() * e // (engine_tp * engine_pp),
            "kv_cache": per_token * seq_len * seqs, "kv_cache_min": per_token * seq_len}
