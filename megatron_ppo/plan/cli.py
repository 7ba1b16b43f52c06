"""`megatron-ppo plan --config FILE [--gpus N] [--gpu-mem-gib M] [key=value ...]`: will this config fit, and how long
will a step take? Per role: every (TP, PP, DP, recompute, offload) layout on the GPUs with its per-GPU memory
broken down, infeasible ones with the reason; then the configured layouts colocated on one GPU (one process per
role: each its resident memory, its own transient peak and a CUDA context), the smallest PP that fits, and a
step-time estimate. Exit 1 when the configured layout does not fit (so scripts can gate on it): in memory, or in
the GPUs (TP x PP x DP ranks, one per GPU: such a layout is marked and gets no step time).

A row's columns are the parts of its total and add up to it: weights + grads + optimizer (resident) + the larger
transient phase, training (activations + logits) or generation (kv_cache), the other phase printed as '-'
(Memory.total in plan/memory.py). What the total leaves out (that phase, the optimizer replicated / distributed,
activations without recompute) is on --breakdown's second line per layout and in --json's ``memory_gib``:
``parts`` (summing to ``total``), ``peak_phase``, ``not_counted``, ``alternatives``."""
from __future__ import annotations

import argparse
import json
import sys

from megatron_ppo.errors import UsageError
from megatron_ppo.plan import comm
from megatron_ppo.plan.layouts import (MARGIN, cannot_run, colocated, comm_times, context_bytes, enumerate_layouts,
                                       process_bytes, recommend_pp, released_peak, role_specs, split_problems,
                                       step_time, with_world)
from megatron_ppo.plan.memory import GIB, Hardware, Memory, total_params, vllm_engine_bytes

# What a row's total is made of (Memory.total = resident + transient, memory.py): the resident parts, held all run,
# plus the larger of the two transient phases, which never overlap (training, then generation, or the reverse).
RESIDENT = ("weights", "grads", "optimizer")
PHASES = {"training": ("activations", "logits"), "generation": ("kv_cache",)}
PARTS = RESIDENT + PHASES["training"] + PHASES["generation"]  # the table's columns, in order, then total
# What the layout could have chosen instead: not part of the total; --breakdown and --json show them.
ALTERNATIVES = ("optimizer_replicated", "optimizer_distributed", "activations_no_recompute")
NOT_COUNTED = "-"  # a cell of the smaller transient phase


def peak_phase(mem: Memory) -> str:
    """The transient phase a total counts: Memory.transient = max(activations + logits, kv_cache)."""
    return "training" if mem.activations + mem.logits >= mem.kv_cache else "generation"


def split(mem: Memory) -> dict:
    """A row's memory in bytes: ``parts`` (summing to ``total`` exactly), the phase they count, the smaller phase
    (``not_counted``) and the ``alternatives`` the layout does not use."""
    phase = peak_phase(mem)
    other = "generation" if phase == "training" else "training"
    return {"total": mem.total, "parts": {k: getattr(mem, k) for k in RESIDENT + PHASES[phase]},
            "peak_phase": phase, "not_counted": {k: getattr(mem, k) for k in PHASES[other]},
            "alternatives": {k: getattr(mem, k) for k in ALTERNATIVES}}


def _in_gib(d):
    return {k: _in_gib(v) for k, v in d.items()} if isinstance(d, dict) else d / GIB if isinstance(d, int) else d


def memory_json(mem: Memory) -> dict:
    return _in_gib(split(mem))


def _legend(unit: str, breakdown: bool) -> list[str]:
    more = ("Under each layout: the phase left out and the memory of the choices the layout does not make" if breakdown
            else "--breakdown adds a line per layout: the phase left out and the choices the layout does not make")
    return [f"Per role, every layout on these GPUs (* the configured one), {unit} per GPU at its worst pipeline stage:",
            "  total = weights + grads + optimizer    resident for the whole run",
            "        + the larger transient phase:    training (activations + logits) or generation (kv_cache); they",
            " " * 41 + f"take turns, so the smaller one shows '{NOT_COUNTED}', not in the total",
            more, "(optimizer replicated / distributed, activations without recompute); --json has the same numbers."]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ppo plan", description=" ".join(__doc__.split("?")[0].split()) + "?")
    p.add_argument("--config", default="tiny_cpu", help="config name in configs/ or a YAML path")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="GPUs in all, in place of the config's cluster.nnodes x cluster.n_gpus_per_node (the "
                        "default); nodes of n_gpus_per_node GPUs (one node when N is fewer), so N must be a "
                        "multiple of it. Every role's TP x PP x DP must fit N (DP = N / (TP x PP) unless "
                        "data_parallel_size is set): a layout that does not is marked, gets no step time, and exits 1")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory per GPU (default 80, H100)")
    p.add_argument("--headroom-gib", type=float, default=6.0, help="kept free per GPU (NCCL buffers, fragmentation)")
    p.add_argument("--cuda-context-gib", type=float, default=None,
                   help="CUDA context per process on a GPU (default 1; 0 for cluster.device=cpu): Hardware in "
                        "plan/memory.py says where the number comes from")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200: 989)")
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="memory bandwidth per GPU (H100 3.35, H200 4.8)")
    p.add_argument("--mfu", type=float, default=0.40, help="model FLOPs utilisation of the training/forward phases")
    p.add_argument("--intra-node-gbs", type=float, default=450.0,
                   help="NVLink GB/s per GPU and direction for groups inside a node (H100/H200 SXM: 450)")
    p.add_argument("--inter-node-gbs", type=float, default=50.0,
                   help="network GB/s per GPU and direction between nodes (one 400 Gb/s NIC per GPU: 50)")
    p.add_argument("--pcie-gbs", type=float, default=Hardware.pcie_gbs,
                   help="host <-> GPU GB/s per GPU and direction (vLLM weight sync, file transport; sleep/wake)")
    p.add_argument("--tmpfs-gbs", type=float, default=Hardware.tmpfs_gbs,
                   help="GB/s of one process writing or reading /dev/shm (vLLM file transport; an assumption)")
    p.add_argument("--shared-fs-gbs", type=float, default=Hardware.shared_fs_gbs,
                   help="GB/s of one stream to a shared rollout.vllm.weights_dir (vLLM file transport; an assumption)")
    p.add_argument("--dp-overlap", type=float, default=0.0,
                   help="share of the DP gradient collectives hidden behind the backward pass (0: this driver)")
    p.add_argument("--all", action="store_true", help="list infeasible layouts too (default: feasible + counts)")
    p.add_argument("--breakdown", action="store_true",
                   help="a second line per layout: the transient phase not in its total and the memory of the "
                        "choices it does not make (optimizer without/with the distributed optimizer, activations "
                        "without recompute)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--placement", action="store_true", help="the rank -> node table of the configured layouts "
                   "(Ray's placement as the driver seats the ranks: nodes filled in order, TP peers together); "
                   "with --json one record per rank")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    return p


class _Unit:
    """One unit for the whole output: GiB, or MiB when every number is under 1 GiB (tiny configs)."""

    def __init__(self, largest: float):
        self.name, self.size = ("GiB", GIB) if largest >= GIB else ("MiB", 2 ** 20)

    def __call__(self, x: float) -> str:
        return f"{x / self.size:.2f}"


def _table(head: list[str], rows: list[list[str]], groups: list[tuple[str, int, int]] = (), corner: str = "",
           left: tuple[int, ...] = (0,), indent: str = "  ") -> list[str]:
    """Aligned text columns: full header names (the width adapts), numbers right-aligned, the columns in ``left``
    and the last one left-aligned. ``groups``: (label, first column, last column) drawn on a line above the
    header, the columns widened where a label needs it; ``corner``: text at the start of that line."""
    n = len(head)
    width = [max([len(head[i])] + [len(r[i]) for r in rows]) for i in range(n)]
    width[0] = max(width[0], len(corner))
    for label, a, b in groups:
        short = len(label) + 2 - (sum(width[a:b + 1]) + 2 * (b - a))
        if short > 0:
            width[b] += short

    def line(cells):
        out = []
        for i, c in enumerate(cells):
            out.append(c if i == n - 1 else c.ljust(width[i]) if i in left else c.rjust(width[i]))
        return (indent + "  ".join(out)).rstrip()

    lines = []
    if groups:
        text, pos = corner, len(corner)
        starts = [sum(width[:i]) + 2 * i for i in range(n)]
        for label, a, b in groups:
            span = starts[b] + width[b] - starts[a]
            text += " " * (starts[a] - pos) + f" {label} ".center(span, "-")
            pos = starts[a] + span
        lines.append((indent + text).rstrip())
    return lines + [line(head)] + [line(r) for r in rows]


def _layout_table(rows, spec, unit: _Unit, breakdown: bool) -> list[str]:
    """The role's layouts: the parts of each row's total, then the total (see the legend in main)."""
    head = ["  layout"] + list(PARTS) + ["total", "note"]
    cells, extra = [], []
    for row in rows:
        s = split(row.mem)
        mark = "*" if row.layout == spec.layout else " "
        cells.append([f"{mark} {row.layout.label()}"]
                     + [unit(s["parts"][k]) if k in s["parts"] else NOT_COUNTED for k in PARTS]
                     + [unit(s["total"]), "; ".join(row.problems) or "ok"])
        extra.append(_breakdown(row, s, unit) if breakdown else None)
    col = {k: 1 + i for i, k in enumerate(PARTS)}  # column index; 0 is the layout
    groups = [(name, col[ks[0]], col[ks[-1]]) for name, ks in (("resident", RESIDENT), *PHASES.items())]
    table = _table(head, cells, groups, corner=f"  {unit.name} per GPU", indent="")
    out = table[:2]
    for line, more in zip(table[2:], extra):
        out.append(line)
        if more:
            out.append("      " + more)
    return out


def _breakdown(row, s: dict, unit: _Unit) -> str:
    """What the row's total leaves out: the smaller transient phase, and the memory of the alternatives to the
    layout's choices (optimizer replicated / distributed, activations without recompute)."""
    m, lay = row.mem, row.layout
    other = "generation" if s["peak_phase"] == "training" else "training"
    if not any(s["not_counted"].values()):
        phase = f"no {other} phase"
    else:
        terms = " + ".join(f"{k} {unit(v)}" for k, v in s["not_counted"].items())
        peak = sum(s["parts"][k] for k in PHASES[s["peak_phase"]])
        phase = f"left out: {other} {terms} (< {s['peak_phase']} {unit(peak)})"
    if not m.optimizer_replicated:  # not trained (ref): no optimizer, forward only
        return f"{phase} | no optimizer | activations: forward only"
    used = ("offloaded to the host, 0 on the GPU" if lay.offload != "none" else
            "distributed used" if lay.distributed_optimizer else "replicated used")
    opt = (f"optimizer replicated {unit(m.optimizer_replicated)}, distributed (/DP{lay.dp}) "
           f"{unit(m.optimizer_distributed)}: {used}")
    act = ("no recompute" if lay.recompute == "none" else
           f"activations without recompute {unit(m.activations_no_recompute)}")
    return f"{phase} | {opt} | {act}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megatron_ppo.config import load_config

    cfg = load_config(args.config, args.overrides)  # the config checks run here: errors name the key
    if args.placement:
        return placement_main(cfg, args.json)
    gpus = args.gpus or cfg.cluster.world_size
    per_node = min(cfg.cluster.n_gpus_per_node, gpus)
    if gpus % per_node:
        raise UsageError(f"--gpus {gpus} is not a multiple of cluster.n_gpus_per_node "
                         f"({cfg.cluster.n_gpus_per_node})")
    context = args.cuda_context_gib
    if context is None:  # a CPU run has no CUDA context
        context = 0.0 if cfg.cluster.device == "cpu" else Hardware.cuda_context_gib
    hw = Hardware(args.gpu_mem_gib, args.peak_tflops, args.hbm_tbps, args.mfu, args.headroom_gib,
                  intra_node_gbs=args.intra_node_gbs, inter_node_gbs=args.inter_node_gbs, dp_overlap=args.dp_overlap,
                  cuda_context_gib=context, pcie_gbs=args.pcie_gbs, tmpfs_gbs=args.tmpfs_gbs,
                  shared_fs_gbs=args.shared_fs_gbs)
    specs = with_world(role_specs(cfg, gpus), gpus)
    rows, total, problems = colocated(specs, hw, per_node, gpus)
    if cfg.cluster.placement == "split":
        problems += split_problems(specs, gpus)
    best_pp = recommend_pp(specs, gpus, hw, per_node)
    blocked = cannot_run(rows) + [p for p in problems if p.startswith("split placement")]
    # a layout that cannot start has no step time: its compute would be spread over GPUs its ranks do not match
    times = None if blocked else step_time(specs, gpus, hw, per_node)
    comms = None if blocked else comm_times(specs, hw, per_node)
    sync = weight_sync_note(cfg)
    vllm = vllm_sync(cfg, specs, hw, per_node, rows, blocked)
    everything = problems + [f"vllm: {p}" for p in (vllm or {}).get("problems", [])]  # the exit status
    listing = {role: enumerate_layouts(spec, gpus, per_node, hw) for role, spec in specs.items()}
    colo_resident = {r: row.mem.resident for r, row in rows.items()}
    colo_process = {r: process_bytes(row.mem, hw) for r, row in rows.items()}
    ctx = context_bytes(hw)
    if args.json:
        print(json.dumps({
            "gpus": gpus, "hardware": hw.__dict__,
            "params": {r: total_params(s.arch, r) for r, s in specs.items()},
            "configured": {r: {"layout": row.layout.label(), "memory_gib": memory_json(row.mem),
                               "problems": row.problems} for r, row in rows.items()},
            # the colocated total: per role process, its resident memory + its own transient peak + a CUDA context
            "colocated": {"total_gib": total / GIB, "process_gib": {r: v / GIB for r, v in colo_process.items()},
                          "resident_gib": {r: v / GIB for r, v in colo_resident.items()},
                          "transient_gib": {r: row.mem.transient / GIB for r, row in rows.items()},
                          "transient_phase": {r: peak_phase(row.mem) for r, row in rows.items()},
                          "context_gib": ctx / GIB, "released_peak_gib": released_peak(rows, hw) / GIB},
            "colocated_gib": total / GIB, "fits": not everything, "problems": everything, "recommended_pp": best_pp,
            "step_time_s": times,  # null when the configured layouts cannot run: step_time_not_estimated says why
            "step_time_not_estimated": blocked or None,
            # communication per phase (in step_time_s as <phase>_comm, comm and step); plan/comm.py
            "comm_s": comms, "comm_assumptions": comm.ASSUMPTIONS, "weight_sync": sync,
            # rollout.name=vllm on GPUs: engines, sync seconds per term (+ bytes), memory in bytes; plan/comm.py
            "vllm": vllm,
            "layouts": {r: [{"layout": row.layout.label(), "tp": row.layout.tp, "pp": row.layout.pp,
                             "dp": row.layout.dp, "recompute": row.layout.recompute, "offload": row.layout.offload,
                             "memory_gib": memory_json(row.mem), "feasible": row.feasible, "problems": row.problems}
                            for row in rs] for r, rs in listing.items()},
        }, indent=1))
        return 0 if not everything else 1
    # the configured layout is always listed, feasible or not (marked *, its note says why it cannot run)
    shown = {r: rs if args.all else [x for x in rs if x.feasible or x.layout == specs[r].layout]
             for r, rs in listing.items()}
    unit = _Unit(max([total] + [x.mem.total for rs in shown.values() for x in rs]))
    u = unit.name
    out = [f"megatron-ppo plan: {args.config} on {gpus} GPUs ({per_node} per node), {hw.gpu_mem_gib:g} GiB each "
           f"({hw.headroom_gib:g} GiB headroom)"
           + (f"; --gpus {gpus} in place of the config's {cfg.cluster.nnodes} node(s) x {cfg.cluster.n_gpus_per_node}"
              f" = {cfg.cluster.world_size} GPUs" if gpus != cfg.cluster.world_size else ""), "",
           *_legend(u, args.breakdown)]
    for role, spec in specs.items():
        n = total_params(spec.arch, role)
        w = spec.work
        out += ["", f"{role}: {n:,} parameters ({n / 1e9:.2f}B); {w.param_bytes * 8}-bit weights, micro-batch {w.micro_batch}"
                f" x {w.seq_len} tokens" + (f", generates {w.gen_batch} sequences per replica" if w.gen_batch else "")]
        rs = listing[role]
        out += _layout_table(shown[role], spec, unit, args.breakdown)
        hidden = [r for r in rs if r not in shown[role]]
        bad = len(hidden)
        if not args.all and bad:
            reasons = {}
            for r in hidden:
                for p in r.problems:
                    key = p.split(" (")[0] if "GiB" not in p else "does not fit alone"
                    reasons[key] = reasons.get(key, 0) + 1
            out.append(f"  ({bad} infeasible layouts not shown; --all lists them: " +
                       "; ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:4]) + ")")
    out += ["", f"configured layouts, colocated ({u} per GPU): one process per role, each holding its resident "
            "memory, its own transient peak (its caching allocator keeps it) and a CUDA context"]
    cells = [[role, row.layout.label()] + [unit(getattr(row.mem, k)) for k in RESIDENT]
             + [unit(row.mem.resident), unit(row.mem.transient), unit(ctx), unit(colo_process[role]),
                peak_phase(row.mem)] for role, row in rows.items()]
    out += _table(["role", "layout", *RESIDENT, "resident", "transient", "context", "process", "phase"], cells,
                  left=(0, 1))
    out.append(f"  total = {len(rows)} processes: resident {unit(sum(colo_resident.values()))} + transient "
               f"{unit(sum(row.mem.transient for row in rows.values()))} + context {unit(ctx * len(rows))} = "
               f"{unit(total)} {u} per GPU of {hw.gpu_mem_gib - hw.headroom_gib:g} GiB usable: "
               + ("FITS" if not problems else "DOES NOT FIT: " + "; ".join(problems)))
    if cfg.cluster.device != "cpu":
        out.append(f"  (ranks on a shared GPU empty their CUDA cache after every call: if all of it came back, the "
                   f"peak would be {unit(released_peak(rows, hw))} {u}, every resident + context and the largest "
                   "transient)")
    out.append(f"  smallest PP at which the colocated roles fit with {MARGIN:.0%} to spare (TP and the rest as "
               f"configured): {best_pp}")
    timing = _time_lines(times, comms, hw, gpus, sync, not problems) if times else _not_estimated(blocked, gpus, sync)
    out += ["", *timing, *_sync_lines(vllm)]
    print("\n".join(out))
    return 0 if not everything else 1


def _not_estimated(blocked: list[str], gpus: int, sync: str) -> list[str]:
    """In place of the step time when a configured layout cannot run on the GPUs."""
    return [f"estimated step time: none: the configured layouts cannot run on {gpus} GPUs: " + "; ".join(blocked),
            f"  weight sync to the rollout engine: {sync}"]


def weight_sync_note(cfg) -> str:
    """What the step time assumes about moving the trained weights to the rollout engine (the one-line summary;
    rollout.name=vllm: ``vllm_sync`` has the plan)."""
    if cfg.rollout.name == "megatron":
        return "none: rollout.name=megatron decodes with the actor's own shards (no copy, no resharding)"
    if cfg.cluster.device == "cpu":
        return (f"rollout.name={cfg.rollout.name} on CPU: not planned (shared memory or files on the host; the "
                "plan's vLLM model is for GPUs)")
    return (f"rollout.name={cfg.rollout.name}: planned below, not in the step time (whose generation is the "
            "Megatron engine's at the actor's layout)")


def vllm_sync(cfg, specs: dict, hw: Hardware, per_node: int, rows: dict, blocked: list[str] = ()) -> dict | None:
    """rollout.name=vllm on GPUs: the engines (plan/comm.py vllm_engines), one step's weight sync
    (weight_sync_seconds) and the GPU memory of the generation phase and of the sync, the roles' processes as
    colocated (the actor's without Megatron's KV cache: vLLM generates) + an engine GPU's; None otherwise, or
    ``{"error": ...}`` where the engines cannot be laid out or the configured layouts cannot run (``blocked``: the
    reasons, already among the plan's problems)."""
    if cfg.rollout.name != "vllm" or cfg.cluster.device == "cpu":
        return None
    if blocked:
        return {"error": "the configured layouts cannot run on these GPUs (above)", "problems": []}
    v, actor = cfg.rollout.vllm, specs["actor"]
    try:
        engines = comm.vllm_engines(actor.layout, per_node, v.tensor_model_parallel_size,
                                    v.pipeline_model_parallel_size)
    except ValueError as err:  # the driver's preflight refuses such a layout too
        return {"error": str(err), "problems": [str(err)]}
    e = actor.work.param_bytes
    directory = v.weights_dir or "/dev/shm"
    spans = len({en.node for en in engines if en.replica == 0}) > 1
    shared = v.weight_transport == "file" and not directory.startswith("/dev/shm")
    out = {"engines": len(engines), "engine_tp": sorted({en.tp for en in engines}),
           "engine_pp": sorted({en.pp for en in engines}), "engine_gpus": sorted({en.gpus for en in engines}),
           "engines_per_replica": len(engines) // actor.layout.dp, "transport": v.weight_transport,
           "bucket_mb": v.bucket_mb, "problems": []}
    if v.weight_transport == "file" and spans and not shared:
        out["problems"].append(f"weight_transport=file with the actor's replica across nodes needs a shared "
                               f"rollout.vllm.weights_dir, not {directory}")
    if v.weight_transport == "file":
        out["file_system"] = ("shared" if shared else "tmpfs") + f" ({directory})"
    sync = comm.weight_sync_seconds(actor.arch, actor.layout, engines, per_node, hw, v.weight_transport,
                                    v.bucket_mb << 20, e, shared_fs=shared)
    out.update(sync)
    n = min(en.gpus for en in engines)
    out["sleep_wake_s"] = comm.sleep_wake_seconds(sync["model_bytes"], n, hw)
    en = min(engines, key=lambda x: x.gpus)  # the most weights per GPU
    seqs = -(-actor.work.gen_batch // out["engines_per_replica"])
    eng = vllm_engine_bytes(actor.arch, en.tp, en.pp, actor.work.seq_len, seqs, e)
    ctx = context_bytes(hw)
    roles = 0
    for role, row in rows.items():
        m = row.mem
        transient = m.activations + m.logits if role == "actor" else m.transient
        roles += m.resident + transient + ctx
    usable = (hw.gpu_mem_gib - hw.headroom_gib) * GIB
    gen = roles + eng["weights"] + eng["kv_cache"] + ctx
    gen_min = roles + eng["weights"] + eng["kv_cache_min"] + ctx
    during_sync = roles + eng["weights"] + ctx + sync["extra_gpu_bytes"]
    out["memory"] = {"roles": roles, "engine_weights": eng["weights"], "engine_kv_cache": eng["kv_cache"],
                     "engine_kv_cache_min": eng["kv_cache_min"], "engine_context": ctx, "sequences_per_engine": seqs,
                     "generation": gen, "generation_min": gen_min, "sync": during_sync, "usable": usable,
                     "host_per_node": max(sum(1 for x in engines if x.node == node) for node in
                                          {x.node for x in engines}) * sync["model_bytes"]}
    if gen_min > usable:
        out["problems"].append(f"vLLM engine: the roles' processes {roles / GIB:.1f} + engine weights "
                               f"{eng['weights'] / GIB:.1f} + one sequence's KV cache {eng['kv_cache_min'] / GIB:.2f}"
                               f" + context {ctx / GIB:g} GiB = {gen_min / GIB:.1f} > {usable / GIB:g} GiB usable")
    if during_sync > usable:
        out["problems"].append(f"weight sync: {during_sync / GIB:.1f} GiB per GPU > {usable / GIB:g} GiB usable")
    return out


def _sync_lines(p: dict | None) -> list[str]:
    """The vLLM plan (``vllm_sync``) as text."""
    if p is None:
        return []
    if "error" in p:
        return [f"  vLLM engines: cannot be laid out: {p['error']}"]
    def g(b):
        return f"{b / 1e9:.1f} GB"

    def gib(b):
        return f"{b / GIB:.2f}"

    tp = "/".join(map(str, p["engine_tp"]))
    pp = "/".join(map(str, p["engine_pp"]))
    gpus = "/".join(map(str, p["engine_gpus"]))
    b = p["bytes"]
    per = {"gather": f"tp0 receives {g(b['gather'])} over NVLink",
           "relay": (f"a stage's tp0 sends / receives {g(b.get('relay_network', 0))} over the network + "
                     f"{g(b.get('relay_nvlink', 0))} over NVLink" if p["terms"].get("relay")
                     else "nothing to relay: each engine's owner holds the whole replica"),
           "ipc": f"the owner's GPU serves {g(b.get('ipc', 0))} over NVLink (P2P)",
           "hbm": f"the owner packs the buckets: {g(b.get('hbm', 0) / 2)} read + {g(b.get('hbm', 0) / 2)} written",
           "d2h": f"tp0 copies {g(b.get('d2h', 0))} to the host over PCIe",
           "write": f"tp0 writes {g(b.get('write', 0))} ({p.get('file_system', '')})",
           "read": f"each engine reads {g(b.get('read', 0))} back",
           "h2d": f"each engine GPU copies {g(b.get('h2d', 0))} over PCIe"}
    m = p["memory"]
    lines = [f"  vLLM engines: {p['engines']} of TP{tp} x PP{pp} ({gpus} GPUs each, on one node), "
             f"{p['engines_per_replica']} per actor replica, each holding the whole model ({g(p['model_bytes'])})",
             f"  weight sync per step (weight_transport={p['transport']}, {p['bucket_mb']} MiB buckets; the worst "
             "GPU per term, phases not overlapped; plan/comm.py):"]
    lines += [f"    {k:<7}{v:7.2f} s  {per[k]}" for k, v in p["terms"].items()]
    lines += [f"    total  {p['total']:7.2f} s per step; not in it: the engine's sleep + wake-up "
              f"{p['sleep_wake_s']:.2f} s (its weights to pinned host memory and back over PCIe)",
              f"  vLLM memory (GiB per GPU): generation = roles' processes {gib(m['roles'])} (the actor's without "
              f"Megatron's KV cache) + engine weights {gib(m['engine_weights'])} + KV cache "
              f"{gib(m['engine_kv_cache'])} ({m['sequences_per_engine']} sequences at full length; one: "
              f"{gib(m['engine_kv_cache_min'])}) + context {gib(m['engine_context'])} = {gib(m['generation'])} of "
              f"{gib(m['usable'])}; during the sync {gib(m['sync'])} (+ {gib(p['extra_gpu_bytes'])} on an owner: "
              f"one bucket, + the largest tensor when larger); the sleeping engines' weights in host memory: "
              f"{g(m['host_per_node'])} per node"]
    lines += [f"  vLLM: {x}" for x in p["problems"]]
    return lines


def _time_lines(times: dict, comms: dict, hw: Hardware, gpus: int, sync: str, fits: bool = True) -> list[str]:
    """The step-time estimate: per phase its compute (or decode) and communication seconds, then the step (in ms
    when the whole step is under a second, as for tiny configs); ``fits`` False: the layouts' ranks fit the GPUs
    but not their memory, which the header says."""
    unit, scale = ("s", 1.0) if times["step"] >= 1 else ("ms", 1e3)

    def row(name, compute, c, total):
        return [name, f"{compute * scale:.2f}", *(f"{c[k] * scale:.2f}" for k in ("tp", "pp", "dp")),
                f"{total * scale:.2f}", f"{(total - compute) / total:.0%}" if total else "-"]

    cells = [row(phase, times[phase], c, times[phase] + times[phase + "_comm"]) for phase, c in comms.items()]
    cells.append(row("step", times["step"] - times["comm"],
                     {k: sum(c[k] for c in comms.values()) for k in ("tp", "pp", "dp")}, times["step"]))
    cond = "" if fits else ", were the configured layouts to fit in memory (they do not: see above)"
    return [f"estimated step time ({unit}) at max lengths{cond}: compute at MFU {hw.mfu:g} of {hw.peak_tflops:g} "
            f"TFLOP/s (decode at {hw.hbm_tbps:g} TB/s); communication at {hw.intra_node_gbs:g} GB/s inside a node, "
            f"{hw.inter_node_gbs:g} GB/s between nodes",
            f"per GPU ({comm.ASSUMPTIONS}; plan/comm.py):",
            *_table(["phase", "compute", "tp_comm", "pp_comm", "dp_comm", "total", "comm share"], cells),
            f"  {times['step'] * scale:.2f} {unit} per step ({times['comm'] * scale:.2f} {unit} of it communication); "
            f"{times['tokens_per_s']:.0f} tokens/s, {times['tokens_per_s'] / gpus:.0f} per GPU",
            f"  weight sync to the rollout engine: {sync}"]


def placement_main(cfg, as_json: bool) -> int:
    """`plan --placement`: where every rank of every role lands (the same records as a run's placement.json,
    nodes named node0.. in the order Ray's PACK fills them; a run names the real hosts)."""
    from megatron_ppo.distributed.placement import format_rank_table, node_key, rank_table, split_tp_groups
    from megatron_ppo.trainer.groups import layouts, plan

    c = cfg.cluster
    role_layouts = layouts(cfg)
    table = rank_table(role_layouts, plan(cfg, node_cpus=1))  # CPUs per rank do not move ranks between nodes
    if as_json:
        print(json.dumps(table, indent=1))
        return 0
    out = [f"megatron-ppo plan --placement: {c.nnodes} node(s) x {c.n_gpus_per_node} slots, {c.placement} "
           "placement; per node, the ranks of each role [their tp / pp / dp coordinates]:"]
    out += ["  " + line for line in format_rank_table(table)]
    for role, layout in role_layouts.items():
        split_groups = split_tp_groups(layout, [node_key(r) for r in table if r["role"] == role])
        out.append(f"{role}: {layout}; " + (f"{len(split_groups)} TP group(s) span nodes: {split_groups[:4]}"
                                             if split_groups else "every TP group inside one node"))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
