"""Layouts of a PPO config: the configured one per role, every alternative on the same GPUs, and whether the
colocated roles fit one GPU together (one process per role, each holding its weights, gradients, optimizer, its own
transient peak and a CUDA context)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_ppo import roles
from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan import comm
from megatron_ppo.plan.memory import (GIB, OFFLOAD, RECOMPUTE, Hardware, Layout, Memory, Workload, decode_seconds,
                                      forward_flops_per_token, memory, phase_seconds)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}  # auto: bf16 on the GPUs a plan is for


def role_arch(cfg, role: str) -> ModelArch:
    """The role's ModelArch without building anything: HF config.json (model.path) or the inline arch, whose
    vocab_size null is the tokenizer's (data.preprocess.tokenizer_vocab_size when the run builds it)."""
    model = cfg.model_for(role)
    if model.path is not None:
        from megatron_ppo.convert.mapping import arch_from_hf_config

        return arch_from_hf_config(model.path)
    fields = dataclasses.asdict(model.arch)
    if fields["vocab_size"] is None:
        if not cfg.data.preprocess.build_tokenizer:
            raise ValueError(f"plan: {role}.model.arch.vocab_size is null and the vocabulary comes from a tokenizer "
                             "the planner does not load; set actor.model.arch.vocab_size")
        fields["vocab_size"] = cfg.data.preprocess.tokenizer_vocab_size
    return ModelArch(**fields)


@dataclass(frozen=True)
class RoleSpec:
    role: str
    arch: ModelArch
    layout: Layout
    work: Workload
    mini_batch: int    # sequences per optimizer step (all DP ranks); 0 for ref
    batch: int         # sequences per PPO step
    epochs: int
    response_len: int  # decode steps of generation
    dp_fixed: bool = False  # cluster.<role>.data_parallel_size set: DP stays as configured on any GPU count


def _recompute(model) -> str:
    return model.recompute_granularity or "none"


def role_specs(cfg, gpus: int | None = None) -> dict[str, RoleSpec]:
    """{role: RoleSpec} for the roles the run builds, at the configured layout on ``gpus`` (default: the world)."""
    world = gpus or cfg.cluster.world_size
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    n = cfg.rollout.n
    batch = cfg.data.train_batch_size * n
    out = {}
    for role in cfg.roles:
        p = getattr(cfg.cluster, role)
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        dp = p.data_parallel_size or max(1, world // (tp * pp))
        model = cfg.model_for(role)
        if role == "actor":
            micro, mini, epochs = cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.ppo_mini_batch_size * n, \
                cfg.actor.ppo_epochs
            dynamic, budget = cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu
        elif role == "critic":
            micro, mini, epochs = cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.ppo_mini_batch_size * n, \
                cfg.critic.ppo_epochs
            dynamic, budget = cfg.critic.use_dynamic_bsz, cfg.critic.ppo_max_token_len_per_gpu
        else:
            micro, mini, epochs = cfg.ref.log_prob_micro_batch_size_per_gpu, 0, 0
            dynamic, budget = cfg.ref.log_prob_use_dynamic_bsz, cfg.ref.log_prob_max_token_len_per_gpu
        if dynamic or not micro:  # a token budget: as many full-length sequences as it holds
            micro = max(1, budget // seq)
        per_dp = max(1, mini // dp) if mini else max(1, batch // dp)
        work = Workload(seq_len=seq, micro_batch=micro, micro_batches=max(1, per_dp // micro),
                        gen_batch=max(1, batch // dp) if role == "actor" else 0,
                        param_bytes=DTYPE_BYTES[model.dtype], trainable=roles.spec(role).trainable)
        layout = Layout(tp, pp, dp, p.sequence_parallel, p.use_distributed_optimizer, _recompute(model))
        out[role] = RoleSpec(role, role_arch(cfg, role), layout, work, mini, batch, epochs,
                             cfg.data.max_response_length, dp_fixed=p.data_parallel_size is not None)
    return out


ALONE = "(alone on the GPU)"  # ends the memory problem of a layout; every other problem means it cannot run at all


def fit_problems(layout: Layout, gpus: int, dp_fixed: bool = False) -> list[str]:
    """Why ``layout``'s ranks cannot be seated on ``gpus`` GPUs, one rank per GPU as the driver seats a role
    (distributed/layout.py check_fits): more ranks than GPUs, or, DP filling the GPUs (data_parallel_size null),
    TP x PP not dividing them (RankLayout.for_world refuses that). Empty: they fit."""
    shard = layout.tp * layout.pp
    ranks = shard * layout.dp
    if ranks > gpus:
        return [f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp} = {ranks} ranks > {gpus} GPUs (one rank per GPU)"]
    if not dp_fixed and gpus % shard:
        return [f"TP{layout.tp} x PP{layout.pp} = {shard} does not divide {gpus} GPUs (DP fills the GPUs unless "
                "data_parallel_size is set)"]
    return []


def layout_problems(spec: RoleSpec, layout: Layout, gpus_per_node: int, gpus: int | None = None) -> list[str]:
    """Why Megatron or the driver cannot run ``layout`` for this role (empty: it can); ``gpus``: also whether its
    ranks fit that many GPUs (fit_problems)."""
    a, out = spec.arch, ([] if gpus is None else fit_problems(layout, gpus, spec.dp_fixed))
    if a.num_attention_heads % layout.tp or a.num_query_groups % layout.tp:
        out.append(f"TP{layout.tp} does not divide heads {a.num_attention_heads} / KV groups {a.num_query_groups}")
    if layout.tp > gpus_per_node:
        out.append(f"TP{layout.tp} spans nodes ({gpus_per_node} GPUs per node)")
    if a.num_layers % layout.pp:
        out.append(f"PP{layout.pp} does not divide {a.num_layers} layers")
    if spec.mini_batch and spec.mini_batch % layout.dp:
        out.append(f"DP{layout.dp} does not divide the mini-batch of {spec.mini_batch} sequences")
    if spec.batch % layout.dp:
        out.append(f"DP{layout.dp} does not divide the batch of {spec.batch} sequences")
    if layout.sp and layout.tp == 1:
        out.append("sequence parallelism needs TP > 1")
    if layout.offload != "none":
        out.append("optimizer offload is a planner option only: the driver does not offload yet")
    return out


@dataclass
class Row:
    role: str
    layout: Layout
    mem: Memory
    problems: list

    @property
    def feasible(self) -> bool:
        return not self.problems


def context_bytes(hw: Hardware) -> int:
    """One process's CUDA context (Hardware.cuda_context_gib; 0 on CPU)."""
    return int(hw.cuda_context_gib * GIB)


def process_bytes(mem: Memory, hw: Hardware) -> int:
    """What one role's process holds on its GPU from its first peak on: resident + its own transient peak (the
    caching allocator keeps what it freed for this process) + a CUDA context."""
    return mem.total + context_bytes(hw)


def evaluate(spec: RoleSpec, layout: Layout, hw: Hardware, gpus_per_node: int, gpus: int | None = None) -> Row:
    """The layout's memory and its problems (``gpus``: on that many GPUs; None: its ranks are not counted)."""
    mem = memory(spec.arch, spec.role, layout, spec.work)
    problems = layout_problems(spec, layout, gpus_per_node, gpus)
    budget = (hw.gpu_mem_gib - hw.headroom_gib) * GIB
    if process_bytes(mem, hw) > budget:
        ctx = f" + {hw.cuda_context_gib:g} GiB CUDA context" if hw.cuda_context_gib else ""
        problems.append(f"needs {mem.total / GIB:.1f} GiB{ctx} > {hw.gpu_mem_gib:g} - {hw.headroom_gib:g} GiB "
                        f"headroom {ALONE}")
    return Row(spec.role, layout, mem, problems)


def enumerate_layouts(spec: RoleSpec, gpus: int, gpus_per_node: int, hw: Hardware) -> list[Row]:
    """Every (TP, PP, DP = gpus / (TP x PP), recompute, offload) for the role, SP on wherever TP > 1; the configured
    layout first when it is none of them (e.g. TP x PP x DP above ``gpus``: there with the reason)."""
    rows = []
    tps = [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0 and gpus % t == 0]
    for tp in tps:
        for pp in range(1, spec.arch.num_layers + 1):
            if spec.arch.num_layers % pp or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            recomputes = RECOMPUTE if spec.work.trainable else ("none",)
            offloads = OFFLOAD if spec.work.trainable else ("none",)
            for rc in recomputes:
                for off in offloads:
                    sp = tp > 1 and (spec.layout.sp or spec.layout.tp == 1)  # the configured choice; on for new TP > 1
                    layout = Layout(tp, pp, dp, sp, spec.layout.distributed_optimizer, rc, off)
                    rows.append(evaluate(spec, layout, hw, gpus_per_node, gpus))
    if all(r.layout != spec.layout for r in rows):
        rows.insert(0, evaluate(spec, spec.layout, hw, gpus_per_node, gpus))
    return rows


def colocated(specs: dict[str, RoleSpec], hw: Hardware, gpus_per_node: int,
              gpus: int | None = None) -> tuple[dict[str, Row], float, list]:
    """The configured layouts sharing every GPU, one process per role: the sum of what each process holds
    (``process_bytes``: resident + its own transient peak + a CUDA context). Not the roles' resident memory + the
    largest transient, as if they shared one allocator: each process's caching allocator keeps its own peak while
    the others run. The driver's ranks on a shared GPU empty their cache after every call (ray_group.RankActor), so
    the real peak is usually nearer ``released_peak``; the plan keeps the bound that holds when they cannot
    (fragmentation: a block stays while any tensor in it lives). ``gpus``: each role's ranks must fit them too."""
    rows = {r: evaluate(s, s.layout, hw, gpus_per_node, gpus) for r, s in specs.items()}
    total = sum(process_bytes(r.mem, hw) for r in rows.values())
    problems = [f"{r}: {p}" for r, row in rows.items() for p in row.problems if ALONE not in p]
    budget = (hw.gpu_mem_gib - hw.headroom_gib) * GIB
    if total > budget:
        problems.append(f"colocated roles need {total / GIB:.1f} GiB per GPU > {hw.gpu_mem_gib:g} - "
                        f"{hw.headroom_gib:g} GiB headroom")
    return rows, total, problems


def cannot_run(rows: dict[str, Row]) -> list[str]:
    """The configured layouts' problems other than memory ("role: why"): such a layout cannot start at all (too
    many ranks for the GPUs, TP not dividing the heads, ...), so it has no step time to estimate."""
    return [f"{r}: {p}" for r, row in rows.items() for p in row.problems if ALONE not in p]


def split_problems(specs: dict[str, RoleSpec], gpus: int) -> list[str]:
    """cluster.placement=split gives each role GPUs of its own: the roles' ranks add up (check_fits)."""
    sizes = {r: s.layout.tp * s.layout.pp * s.layout.dp for r, s in specs.items()}
    if sum(sizes.values()) <= gpus:
        return []
    terms = " + ".join(f"{r} {n}" for r, n in sizes.items())
    return [f"split placement: {terms} = {sum(sizes.values())} ranks > {gpus} GPUs"]


def released_peak(rows: dict[str, Row], hw: Hardware) -> int:
    """The colocated peak if every role gave all its transient memory back after each call: every process's
    resident memory and context + the largest transient (the roles take turns)."""
    return sum(r.mem.resident + context_bytes(hw) for r in rows.values()) + max(r.mem.transient for r in rows.values())


MARGIN = 0.15  # the tolerance docs/scaling.md validates the parameter/optimizer memory model to


def recommend_pp(specs: dict[str, RoleSpec], gpus: int, hw: Hardware, gpus_per_node: int,
                 margin: float = MARGIN) -> int | None:
    """The smallest PP (same for every role, TP and the rest as configured) at which the colocated roles fit even
    if the model underestimates by ``margin``."""
    arch = specs["actor"].arch
    tp = max(s.layout.tp for s in specs.values())
    for pp in range(1, arch.num_layers + 1):
        if arch.num_layers % pp or gpus % (tp * pp):
            continue
        trial = {r: dataclasses.replace(s, layout=dataclasses.replace(
            s.layout, pp=pp, dp=gpus // (s.layout.tp * pp))) for r, s in specs.items()
            if gpus % (s.layout.tp * pp) == 0}
        if len(trial) != len(specs):
            continue
        _, total, problems = colocated(trial, hw, gpus_per_node, gpus)
        if not problems and total * (1 + margin) <= (hw.gpu_mem_gib - hw.headroom_gib) * GIB:
            return pp
    return None


def phase_names(role: str, trainable: bool) -> tuple[str, ...]:
    """The step_time phases of a role: its forward pass (and its update when trainable)."""
    if not trainable:  # ref: its log-probs; reward: its scores
        return (f"{role}_log_prob" if role == "ref" else f"{role}_score",)
    return ("values" if role == "critic" else "old_log_prob", f"{role}_update")


def comm_times(specs: dict[str, RoleSpec], hw: Hardware, gpus_per_node: int = 8) -> dict[str, dict[str, float]]:
    """{phase: {"tp", "pp", "dp"}} seconds of communication per phase at max lengths (plan/comm.py): a forward
    phase's TP collectives and p2p activations; an update's forward + backward (+ the recomputed forward's TP) and
    its DP gradient step per optimizer step; generation's per-token TP all-reduces and p2p."""
    actor = specs["actor"]
    out = {}
    for role, spec in specs.items():
        lay, w = spec.layout, spec.work
        e, seq = w.param_bytes, w.seq_len
        tokens = spec.batch * seq / lay.dp  # one DP replica's tokens
        micro_tokens = w.micro_batch * seq
        forward, update = (phase_names(role, w.trainable) + (None,))[:2]
        out[forward] = {"tp": comm.tp_seconds(spec.arch, lay, tokens, 1, w.micro_batches, e, hw, gpus_per_node),
                        "pp": comm.pp_seconds(spec.arch, lay, tokens, micro_tokens, 1, w.micro_batches, e, hw,
                                              gpus_per_node),
                        "dp": 0.0}
        if update is None:
            continue
        passes = 3 if lay.recompute == "full" else 2
        steps = spec.epochs * max(1, -(-spec.batch // spec.mini_batch)) if spec.mini_batch else 0
        params = memory(spec.arch, role, lay, w).params
        out[update] = {
            "tp": spec.epochs * comm.tp_seconds(spec.arch, lay, tokens, passes, w.micro_batches, e, hw, gpus_per_node),
            "pp": spec.epochs * comm.pp_seconds(spec.arch, lay, tokens, micro_tokens, 2, w.micro_batches, e, hw,
                                                gpus_per_node),
            "dp": comm.dp_seconds(params, lay, steps, e, w.grad_bytes, hw, gpus_per_node)}
    gen_tokens = actor.work.gen_batch * actor.work.seq_len
    out["generate"] = comm.generate_seconds(actor.arch, actor.layout, gen_tokens, actor.work.param_bytes, hw,
                                            gpus_per_node)
    return out


def step_time(specs: dict[str, RoleSpec], gpus: int, hw: Hardware, gpus_per_node: int = 8) -> dict[str, float]:
    """Seconds per PPO step by phase at max lengths: FLOPs at hw.mfu for forward/training phases (x4/3 for full
    recompute, x(1 + (PP-1)/m) pipeline bubble), and generation as the slower of FLOPs at hw.mfu and memory-bound
    decoding (each decode step reads the rank's weights and KV cache). These phase keys are compute only; each
    phase's communication (comm_times, plan/comm.py) is its ``<phase>_comm`` key, ``comm`` their sum, and ``step``
    adds both (communication is not overlapped with compute, except DP's ``hw.dp_overlap``)."""
    actor = specs["actor"]
    seq, batch = actor.work.seq_len, actor.batch
    out = {}
    for role, spec in specs.items():
        tokens = batch * seq
        fwd = forward_flops_per_token(spec.arch, seq) * tokens
        lay = spec.layout
        bubble = 1 + (lay.pp - 1) / max(1, spec.work.micro_batches)
        names = phase_names(role, spec.work.trainable)
        out[names[0]] = phase_seconds(fwd, gpus, hw) * bubble
        if len(names) > 1:
            train = 3 * fwd + (fwd if lay.recompute == "full" else 0)
            out[names[1]] = phase_seconds(train * spec.epochs, gpus, hw) * bubble
    mem = memory(actor.arch, "actor", actor.layout, actor.work)
    gen_flops = forward_flops_per_token(actor.arch, seq) * batch * seq
    out["generate"] = max(phase_seconds(gen_flops, gpus, hw),
                          decode_seconds(actor.response_len, mem.weights + mem.kv_cache, hw) * actor.layout.pp)
    compute = sum(out.values())
    comms = comm_times(specs, hw, gpus_per_node)
    for phase in list(out):
        out[f"{phase}_comm"] = sum(comms[phase].values())
    out["comm"] = sum(sum(c.values()) for c in comms.values())
    out["step"] = compute + out["comm"]
    out["tokens_per_s"] = batch * seq / out["step"]
    return out


def with_world(specs: dict[str, RoleSpec], gpus: int) -> dict[str, RoleSpec]:
    """The configured TP/PP on ``gpus`` GPUs: DP = gpus / (TP x PP), at least 1, unless the config fixes it (then
    TP x PP x DP may exceed ``gpus``: fit_problems says so)."""
    return {r: s if s.dp_fixed else dataclasses.replace(s, layout=dataclasses.replace(
        s.layout, dp=max(1, gpus // (s.layout.tp * s.layout.pp)))) for r, s in specs.items()}


__all__ = ["RoleSpec", "Row", "role_specs", "enumerate_layouts", "colocated", "released_peak", "process_bytes",
           "context_bytes", "recommend_pp", "step_time",
           "comm_times", "phase_names", "evaluate", "layout_problems", "role_arch", "with_world", "fit_problems",
           "cannot_run", "split_problems", "ALONE"]
