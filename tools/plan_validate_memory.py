"""Planner vs measurement: weights, gradients and optimizer states of a real Megatron actor shard (fp32, CPU, 2
gloo ranks) at TP1 / DP2 with and without the distributed optimizer / TP2 / PP2, as RSS growth next to what
`megatron-ppo plan`'s memory model predicts for the same rank. Prints a markdown table (docs/scaling.md) and
exits 1 if any parameter or optimizer term is off by more than --tolerance.

    .venv/bin/python tools/plan_validate_memory.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

MIB = 2 ** 20


def table(rows: list[dict]) -> tuple[str, float]:
    lines = ["| layout | rank | params | weights MiB (pred / meas) | grads MiB | optimizer MiB | worst error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    worst = 0.0
    for r in rows:
        errs = {k: abs(r["measured"][k] - r["predicted"][k]) / r["predicted"][k] for k in r["predicted"]}
        worst = max(worst, *errs.values())
        lay = f"TP{r['tp']} PP{r['pp']} DP{r['dp']}" + (" dist-opt" if r["distributed_optimizer"] else "")
        cells = " | ".join(f"{r['predicted'][k] / MIB:.1f} / {r['measured'][k] / MIB:.1f}"
                           for k in ("weights", "grads", "optimizer"))
        lines.append(f"| {lay} | {r['rank']} | {r['params']:,} | {cells} | {max(errs.values()):.1%} |")
    return "\n".join(lines), worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the raw rows here")
    p.add_argument("--tolerance", type=float, default=0.15)
    args = p.parse_args(argv)
    # Every allocation above 64 KiB gets its own mmap and goes back to the OS when freed: otherwise glibc's dynamic
    # threshold keeps freed init temporaries in the heap and later tensors reuse them, and RSS says nothing.
    # The spawned ranks inherit this (glibc reads it at process start).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    from megatron_ppo.parallel.launch import LocalWorkerPool
    from megatron_ppo.plan.measure import MEASURE_ARCH, measure_layouts

    with LocalWorkerPool(2) as pool:
        rows = measure_layouts(pool)
    text, worst = table(rows)
    print(f"arch: {MEASURE_ARCH}\n\n{text}\n\nworst relative error: {worst:.1%} (tolerance {args.tolerance:.0%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
