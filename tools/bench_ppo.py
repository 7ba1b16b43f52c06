"""Per-phase time of PPO steps, in-process (LocalWorkerGroup) vs Ray (RayWorkerGroup) at the same layout
(TP = PP = DP = 1 per role), and peak RSS per rank: what the Ray dispatch costs as a share of a step.

    python tools/bench_ppo.py --steps 4 --out docs/bench/ppo.md
    python tools/bench_ppo.py --steps 2 --arch smollm2-135m --out docs/bench/ppo.md   # + a ~135M-parameter row

Each launcher runs `--steps` steps of configs/tiny_cpu.yaml (GSM8K prompts, built BPE tokenizer) in its own
subprocess; step 1 (warm-up: first generation, allocator) is dropped and the rest are averaged.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("gen", "reward", "old_log_prob", "adv", "update_critic", "update_actor", "step")
DISPATCH = "dispatch"  # Ray only: wall time of the group calls minus the ranks' own time in the methods
ARCHS = {  # SmolLM2-135M's shape (random init)
    "smollm2-135m": "{num_layers: 30, hidden_size: 576, ffn_hidden_size: 1536, num_attention_heads: 9, "
                    "num_query_groups: 3, vocab_size: 49152, max_position_embeddings: 2048, tie_word_embeddings: true}",
}


def overrides(launcher: str, steps: int, out_dir: str, arch: str | None, threads: int | None) -> list[str]:
    over = [f"cluster.launcher={launcher}", "cluster.n_gpus_per_node=1", "cluster.actor.tensor_model_parallel_size=1",
            "cluster.ref.tensor_model_parallel_size=1", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
            "trainer.logger=[jsonl]", f"trainer.log_dir={out_dir}/logs", "trainer.overwrite=true"]
    if arch:
        over.append(f"actor.model.arch={ARCHS[arch]}")
    if threads is not None:  # else the product's default, cluster.num_cpus_per_rank=auto
        over.append(f"cluster.num_cpus_per_rank={threads}")
    return over


def run_one(launcher: str, steps: int, out_dir: str, arch: str | None, threads: int | None) -> dict:
    """In this (fresh) process: build, fit, report per-step timings, start-up time and peak RSS per rank.

    ``threads`` (None: the product's default, cluster.num_cpus_per_rank=auto, i.e. every CPU of the machine for
    one rank per role) torch threads compute in both cases: in-process here, on Ray in each rank (a rank's thread
    count is its bundle's CPUs), so the two runs differ only in where the work runs."""
    import resource

    import torch

    from megatron_ppo.config import load_config
    from megatron_ppo.testing.probes import PROBED_WORKERS
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    from megatron_ppo.config import to_yaml
    from megatron_ppo.trainer.tracking import claim_log_dir

    cfg = load_config("tiny_cpu", overrides(launcher, steps, out_dir, arch, threads))
    claim_log_dir(cfg.trainer, to_yaml(cfg))  # trainer.overwrite=true: a re-run replaces the last one's records
    start = time.perf_counter()
    parts = build_components(cfg, worker_classes=PROBED_WORKERS)  # + peak_rss_mb (testing/probes.py)
    try:
        build_s = time.perf_counter() - start
        history = PPOTrainer(cfg, parts).fit(steps)
        rss = {role: group.call_all("peak_rss_mb") for role, group in parts.groups.groups.items()}
        rank_threads = {role: group.call_all("torch_threads") for role, group in parts.groups.groups.items()}
        params = sum(p.numel() for p in parts.actor.worker.model.parameters()) if launcher == "local" else None
    finally:
        parts.close()
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"launcher": launcher, "build_s": build_s, "rss_mb": rss, "driver_rss_mb": driver, "params": params,
            "threads": rank_threads,
            "steps": [{p: m[f"timing/{p}"] for p in PHASES + (DISPATCH,) if f"timing/{p}" in m} for m in history]}


def mean_after_warmup(steps: list[dict]) -> dict:
    rest = steps[1:] or steps
    return {p: sum(s.get(p, 0.0) for s in rest) / len(rest) for p in PHASES + (DISPATCH,)}


def section(results: dict, args, cmd: str) -> str:
    lines = ["# PPO step: in-process vs Ray worker groups (issue 12)", "",
             "Produced by `tools/bench_ppo.py`: configs/tiny_cpu.yaml at TP = PP = DP = 1 per role (actor, critic, "
             "reference), once with `cluster.launcher=local` (LocalWorkerGroup: every role in the driver process) "
             "and once with `cluster.launcher=ray` (one Ray actor per role, colocated on one bundle), each in a fresh "
             "process; mean of the steps after the first (warm-up). Both compute with the same torch thread count "
             + (f"(`--threads {args.threads}`: in-process, and per Ray rank via cluster.num_cpus_per_rank). " if
                args.threads else "(the product's default, cluster.num_cpus_per_rank=auto: every CPU of the "
                "machine in-process and per Ray rank; the Ray ranks' counts are listed below). ") + "Two "
             "measures of what Ray costs: the difference of the two runs (noisy: separate runs on a shared "
             "machine), and `dispatch`, measured inside the Ray run: each group call's wall time on the driver "
             "minus its slowest rank's own time in the method, i.e. serialisation + RPC + gather (`timing/dispatch` "
             "in every Ray run's metrics). Design: [../trainer.md](../trainer.md).", "",
             f"Command: `{cmd}`", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (load average "
             f"{os.getloadavg()[0]:.1f} at the start: the machine may be shared); {time.strftime('%Y-%m-%d')}.", ""]
    for name, (local, ray) in results.items():
        lo, ra = mean_after_warmup(local["steps"]), mean_after_warmup(ray["steps"])
        params = f", {local['params'] / 1e6:.1f} M parameters per model" if local.get("params") else ""
        lines += [f"### {name}{params}", "",
                  "| phase | in-process (s) | Ray (s) | Ray - in-process (s) | share of the Ray step |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for p in PHASES:
            lines.append(f"| {p} | {lo[p]:.3f} | {ra[p]:.3f} | {ra[p] - lo[p]:+.3f} | "
                         f"{(ra[p] - lo[p]) / ra['step'] * 100:+.1f} % |")
        lines.append(f"| **dispatch** (in the Ray run) | - | {ra[DISPATCH]:.3f} | | "
                     f"**{ra[DISPATCH] / ra['step'] * 100:.1f} %** |")
        lines += ["", f"Torch threads per Ray rank: {ray['threads']}.", "", f"Start-up (data, tokenizer, models; Ray: cluster + placement + 3 groups): in-process "
                      f"{local['build_s']:.1f} s, Ray {ray['build_s']:.1f} s.", "",
                  "| peak RSS (MiB) | " + " | ".join(ray["rss_mb"]) + " | driver |",
                  "| --- | " + " | ".join("---:" for _ in ray["rss_mb"]) + " | ---: |",
                  "| in-process (one process) | " + " | ".join("-" for _ in ray["rss_mb"]) +
                  f" | {local['driver_rss_mb']:.0f} |",
                  "| Ray (per rank) | " + " | ".join(f"{v[0]:.0f}" for v in ray["rss_mb"].values()) +
                  f" | {ray['driver_rss_mb']:.0f} |", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--arch", choices=sorted(ARCHS), default=None, help="add a row with this model shape")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads in both runs (cluster.num_cpus_per_rank; "
                    "default: the product's default, auto)")
    ap.add_argument("--one", nargs=3, metavar=("LAUNCHER", "DIR", "ARCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        launcher, out_dir, arch = args.one
        print("RESULT " + json.dumps(run_one(launcher, args.steps, out_dir, None if arch == "-" else arch,
                                             None if args.threads in (None, 0) else args.threads)))
        return
    results = {}
    for arch in [None] + ([args.arch] if args.arch else []):
        pair = []
        for launcher in ("local", "ray"):
            out_dir = f"outputs/bench_ppo/{arch or 'tiny'}_{launcher}"
            proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--threads",
                                   str(args.threads or 0), "--one", launcher, out_dir,
                                   arch or "-"], cwd=REPO, capture_output=True, text=True)
            found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not found:
                raise SystemExit(f"{launcher} run failed:\n{proc.stderr[-4000:]}")
            pair.append(json.loads(found[-1][len("RESULT "):]))
            print(f"{arch or 'tiny'} {launcher}: {mean_after_warmup(pair[-1]['steps'])}", flush=True)
        results["tiny_cpu model (2 layers, 64 wide)" if arch is None else f"{arch} shape"] = tuple(pair)
    cmd = "python tools/bench_ppo.py " + " ".join(sys.argv[1:])
    text = section(results, args, cmd)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
