"""Scaling sweep: run a PPO config over rank counts and model sizes, collect tokens/s, step time per phase and peak
memory into one CSV, and plot strong scaling (fixed batch, more ranks) and weak scaling (batch grows with ranks).

    .venv/bin/python tools/scaling_sweep.py --out outputs/scaling            # tiny models, local Ray, CPU
    .venv/bin/python tools/scaling_sweep.py --slurm --ranks 1 2 ...           # each point `sbatch --wait` of
                                                                              # --script (slurm/ppo_tiny.sh)
Each point is `megatron-ppo train` with cluster.* overrides (actor, critic and reference DP = ranks, TP = PP = 1
unless --tp) and trainer.total_training_steps=--steps; the first step (warm-up) is left out of the averages.
With --slurm, each point is a job of --script with --config as CONFIG, `--cpus-per-task=<ranks>`, any
--sbatch-arg (partition, account, ...) and the point's directory as MPPO_RUN_DIR; it needs sbatch on PATH (and
SLURM_CONF where the cluster is not the default one) and is run from a directory every node sees.
Peak memory: the largest RSS of one rank process (local runs; Slurm jobs report none: the ranks run on the
cluster's nodes, not under this process).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"h64": dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2),
          "h128": dict(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2)}
FIELDS = ["mode", "model", "ranks", "tp", "batch", "steps", "tokens_per_s", "step_s", "gen_s", "old_log_prob_s",
          "update_actor_s", "update_critic_s", "peak_rank_rss_mib", "wall_s"]


def overrides(model: str, ranks: int, tp: int, batch: int, steps: int, log_dir: Path) -> list[str]:
    dp = ranks // tp
    out = [f"cluster.n_gpus_per_node={ranks}", "cluster.nnodes=1", f"data.train_batch_size={batch}",
           f"trainer.total_training_steps={steps + 1}", f"trainer.log_dir={log_dir}", "trainer.overwrite=true",
           "trainer.test_freq=-1", f"data.train_max_samples={batch * (steps + 1)}",
           f"actor.ppo_mini_batch_size={batch}", f"critic.ppo_mini_batch_size={batch}",
           f"actor.ppo_micro_batch_size_per_gpu={max(1, batch // dp)}",
           f"critic.ppo_micro_batch_size_per_gpu={max(1, batch // dp)}"]
    for role in ("actor", "critic", "ref"):
        out += [f"cluster.{role}.tensor_model_parallel_size={tp}", f"cluster.{role}.data_parallel_size={dp}"]
    out += [f"actor.model.arch.{k}={v}" for k, v in MODELS[model].items()]
    return out


def _peak_rss(root_pid: int, peak: dict) -> None:
    import psutil

    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return
    for p in procs:
        try:
            if "ray::" in p.name() or any("ray::" in c for c in p.cmdline()[:1]):
                peak["rss"] = max(peak.get("rss", 0), p.memory_info().rss)
        except psutil.Error:
            pass


def run_point(args, model: str, ranks: int, batch: int, mode: str) -> dict:
    log_dir = Path(args.out).resolve() / f"{mode}_{model}_r{ranks}_b{batch}"  # the runs' cwd is the repo
    ov = overrides(model, ranks, args.tp, batch, args.steps, log_dir / "logs")
    start, peak = time.monotonic(), {}
    if args.slurm:
        cmd = ["sbatch", "--wait", f"--output={log_dir}/job.out", f"--cpus-per-task={ranks}",
               f"--export=ALL,CONFIG={args.config},MPPO_RUN_DIR={log_dir}", *args.sbatch_arg, args.script, *ov]
    else:
        cmd = [str(REPO / ".venv/bin/megatron-ppo"), "train", "--config", args.config, *ov] + (
            [f"cluster.num_cpus_per_rank={args.cpus_per_rank}"] if args.cpus_per_rank else [])
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            _peak_rss(proc.pid, peak)
            time.sleep(0.5)
    if proc.returncode:
        job_out = f" and {log_dir}/job.out" if args.slurm else ""
        raise SystemExit(f"scaling_sweep: {' '.join(cmd[:4])} ... failed ({proc.returncode}); see {log_dir}/run.log"
                         f"{job_out}")
    recs = [json.loads(x) for x in (log_dir / "logs/metrics.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "timing/step" in r][1:]  # drop the warm-up step

    def mean(key):
        vals = [r[key] for r in recs if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    return {"mode": mode, "model": model, "ranks": ranks, "tp": args.tp, "batch": batch, "steps": len(recs),
            "tokens_per_s": mean("perf/tokens_per_s"), "step_s": mean("timing/step"), "gen_s": mean("timing/gen"),
            "old_log_prob_s": mean("timing/old_log_prob"), "update_actor_s": mean("timing/update_actor"),
            "update_critic_s": mean("timing/update_critic"),
            "peak_rank_rss_mib": peak.get("rss", 0) / 2 ** 20 if peak else float("nan"),
            "wall_s": time.monotonic() - start}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, mode, title in ((axes[0], "strong", "strong scaling (fixed batch)"),
                            (axes[1], "weak", "weak scaling (batch per rank fixed)")):
        for model in sorted({r["model"] for r in rows}):
            pts = sorted((r["ranks"], r["tokens_per_s"]) for r in rows if r["mode"] == mode and r["model"] == model)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=model)
        ax.set_xlabel("ranks")
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--out", default="outputs/scaling")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch", type=int, default=8, help="strong scaling: prompts per step")
    p.add_argument("--batch-per-rank", type=int, default=4, help="weak scaling: prompts per step per rank")
    p.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up step)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cpus-per-rank", type=float, default=None,
                   help="cluster.num_cpus_per_rank of every point (default: the product's, auto)")
    p.add_argument("--modes", nargs="+", default=["strong", "weak"], choices=["strong", "weak"])
    p.add_argument("--slurm", action="store_true", help="each point as `sbatch --wait SCRIPT`")
    p.add_argument("--script", default="slurm/ppo_tiny.sh", help="--slurm: the job script (repo-relative)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="--slurm: one more sbatch option, e.g. --sbatch-arg=--partition=cpu (repeatable)")
    p.add_argument("--csv", default="docs/scaling.csv")
    p.add_argument("--png", default="docs/scaling.png")
    args = p.parse_args(argv)
    rows = []
    for model in args.models:
        for ranks in args.ranks:
            for mode in args.modes:
                batch = args.batch if mode == "strong" else args.batch_per_rank * ranks
                if mode == "weak" and batch == args.batch and "strong" in args.modes:
                    rows.append({**next(r for r in rows if r["model"] == model and r["ranks"] == ranks
                                        and r["mode"] == "strong"), "mode": "weak"})
                    continue
                rows.append(run_point(args, model, ranks, batch, mode))
                print(json.dumps(rows[-1]), flush=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    plot(rows, Path(args.png))
    print(f"scaling_sweep: {len(rows)} points -> {args.csv}, {args.png}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
