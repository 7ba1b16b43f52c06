"""`megatron-ppo plan --config FILE [--gpus N] [--gpu-mem-gib M] [key=value ...]`: will this config fit, and how long
will a step take? Per role: every (TP, PP, DP, recompute, offload) layout on the GPUs with its per-GPU memory
broken down, infeasible ones with the reason; then the configured layouts colocated on one GPU, the smallest PP
that fits, and a step-time estimate. Exit 1 when the configured layout does not fit (so scripts can gate on it)."""
from __future__ import annotations

import argparse
import json
import sys

from megatron_ppo.plan.layouts import MARGIN, colocated, enumerate_layouts, recommend_pp, role_specs, step_time, with_world
from megatron_ppo.plan.memory import GIB, Hardware, total_params

COLUMNS = ("weights", "grads", "optimizer", "optimizer_replicated", "optimizer_distributed", "activations",
           "activations_no_recompute", "logits", "kv_cache", "total")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ppo plan", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny_cpu", help="config name in configs/ or a YAML path")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: cluster.nnodes x n_gpus_per_node)")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory per GPU (default 80, H100)")
    p.add_argument("--headroom-gib", type=float, default=6.0, help="kept free per GPU (context, NCCL, fragmentation)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200: 989)")
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="memory bandwidth per GPU (H100 3.35, H200 4.8)")
    p.add_argument("--mfu", type=float, default=0.40, help="model FLOPs utilisation of the training/forward phases")
    p.add_argument("--all", action="store_true", help="list infeasible layouts too (default: feasible + counts)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    return p


def _gib(x: float) -> str:
    return f"{x / GIB:7.2f}" if x >= GIB / 100 or x == 0 else f"{x / 2**20:6.2f}M"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megatron_ppo.config import load_config

    cfg = load_config(args.config, args.overrides)  # the config checks run here: errors name the key
    gpus = args.gpus or cfg.cluster.world_size
    per_node = min(cfg.cluster.n_gpus_per_node, gpus)
    if gpus % per_node:
        raise SystemExit(f"megatron-ppo plan: --gpus {gpus} is not a multiple of cluster.n_gpus_per_node "
                         f"({cfg.cluster.n_gpus_per_node})")
    hw = Hardware(args.gpu_mem_gib, args.peak_tflops, args.hbm_tbps, args.mfu, args.headroom_gib)
    specs = with_world(role_specs(cfg, gpus), gpus)
    rows, total, problems = colocated(specs, hw, per_node)
    best_pp = recommend_pp(specs, gpus, hw, per_node)
    times = step_time(specs, gpus, hw)
    listing = {role: enumerate_layouts(spec, gpus, per_node, hw) for role, spec in specs.items()}
    if args.json:
        print(json.dumps({
            "gpus": gpus, "hardware": hw.__dict__,
            "params": {r: total_params(s.arch, r) for r, s in specs.items()},
            "configured": {r: {"layout": row.layout.label(), "gib": row.mem.as_gib(), "problems": row.problems}
                           for r, row in rows.items()},
            "colocated_gib": total / GIB, "fits": not problems, "problems": problems, "recommended_pp": best_pp,
            "step_time_s": times,
            "layouts": {r: [{"layout": row.layout.label(), "tp": row.layout.tp, "pp": row.layout.pp,
                             "dp": row.layout.dp, "recompute": row.layout.recompute, "offload": row.layout.offload,
                             "gib": row.mem.as_gib(), "feasible": row.feasible, "problems": row.problems}
                            for row in rs] for r, rs in listing.items()},
        }, indent=1))
        return 0 if not problems else 1
    out = [f"megatron-ppo plan: {args.config} on {gpus} GPUs ({per_node} per node), {hw.gpu_mem_gib:g} GiB each "
           f"({hw.headroom_gib:g} GiB headroom); GiB per GPU (M: MiB), worst pipeline stage"]
    head = f"  {'layout':<34}" + "".join(f"{c[:10]:>11}" for c in COLUMNS) + "  note"
    for role, spec in specs.items():
        n = total_params(spec.arch, role)
        w = spec.work
        out += ["", f"{role}: {n:,} parameters ({n / 1e9:.2f}B); {w.param_bytes * 8}-bit weights, micro-batch {w.micro_batch}"
                f" x {w.seq_len} tokens" + (f", generates {w.gen_batch} sequences per replica" if w.gen_batch else ""),
                head]
        rs = listing[role]
        shown = rs if args.all else [r for r in rs if r.feasible]
        for row in shown:
            d = row.mem.as_gib()
            cells = "".join(f"{_gib(d[c] * GIB):>11}" for c in COLUMNS)
            mark = "*" if row.layout == spec.layout else " "
            out.append(f"{mark} {row.layout.label():<34}{cells}  {'; '.join(row.problems) or 'ok'}")
        bad = len(rs) - sum(r.feasible for r in rs)
        if not args.all and bad:
            reasons = {}
            for r in rs:
                for p in r.problems:
                    key = p.split(" (")[0] if "GiB" not in p else "does not fit alone"
                    reasons[key] = reasons.get(key, 0) + 1
            out.append(f"  ({bad} infeasible layouts not shown; --all lists them: " +
                       "; ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])[:4]) + ")")
    out += ["", "configured layouts, colocated (every role's weights, grads and optimizer resident on each GPU):"]
    for role, row in rows.items():
        m = row.mem
        out.append(f"  {role:<7}{row.layout.label():<36} resident {_gib(m.resident)}  transient {_gib(m.transient)}"
                   f"  (weights {_gib(m.weights).strip()}, grads {_gib(m.grads).strip()}, optimizer "
                   f"{_gib(m.optimizer).strip()}, activations {_gib(m.activations).strip()}, logits "
                   f"{_gib(m.logits).strip()}, kv {_gib(m.kv_cache).strip()})")
    out.append(f"  total {total / GIB:.1f} GiB per GPU of {hw.gpu_mem_gib - hw.headroom_gib:g} usable: "
               + ("FITS" if not problems else "DOES NOT FIT: " + "; ".join(problems)))
    out.append(f"  smallest PP at which the colocated roles fit with {MARGIN:.0%} to spare (TP and the rest as "
               f"configured): {best_pp}")
    phases = ", ".join(f"{k} {v:.1f}" for k, v in times.items() if k not in ("step", "tokens_per_s"))
    out += ["", f"estimated step time at MFU {hw.mfu:g} ({hw.peak_tflops:g} TFLOP/s peak, {hw.hbm_tbps:g} TB/s "
            f"decode), max lengths: {times['step']:.1f} s ({phases}); {times['tokens_per_s']:.0f} tokens/s"]
    print("\n".join(out))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
