"""Does one step off-policy PPO learn as well as synchronous PPO? `make train`'s task (configs/tiny_cpu.yaml: the
generated arithmetic task, the default layout and its 30 steps) with rollout.name=vllm, per seed: synchronous
(`sync`) and `trainer.async_rollout=one_step` with token-level truncated IS (threshold 2) correcting the
one-update-stale rollout (`one_step`). Only the attention heads change (2 instead of 4: vLLM's CPU attention has no
head dim 16). Margin = mean reward of the last 5 steps minus the first 5 (as tools/bench_learning.py).

"Within noise" (issue 28): the difference of the two modes' mean last-5 rewards over the seeds is within two
standard errors of that difference (from the seed-to-seed spread of each mode).

Writes docs/bench/async_learning.md and its reward-curve PNG (then run tools/collect_benchmarks.py).

    python tools/bench_async_learning.py --seeds 1 2 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from bench_async import IS_TOKEN, save_reward_plot  # noqa: E402

VLLM = ("rollout.name=vllm", "actor.model.arch.num_attention_heads=2", "rollout.vllm.cpu_kv_cache_gib=0.25")
MODES = {"sync": (), "one_step": ("trainer.async_rollout=one_step",) + IS_TOKEN}


def vllm_python() -> str:
    path = REPO / ".venv-vllm" / "bin" / "python"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `make setup-vllm` first")
    return str(path)


def run(work: Path, mode: str, seed: int, data: Path, reuse: bool) -> dict:
    """One `megatron-ppo train` run; returns its step records and wall time (a finished run is kept with reuse)."""
    out = work / f"{mode}-seed{seed}"
    metrics, wall_file = out / "logs" / "metrics.jsonl", out / "wall_s"
    if not (reuse and wall_file.is_file() and metrics.is_file()):
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
               "trainer.overwrite=true", f"trainer.seed={seed}", f"trainer.log_dir={out / 'logs'}",
               f"trainer.default_local_dir={out / 'ckpt'}", "trainer.save_freq=-1",
               f"rollout.vllm.python={vllm_python()}", f"rollout.vllm.weights_dir={out / 'shm'}",
               f"data.preprocess.output_dir={data}", f"data.train_files=[{data / 'train.parquet'}]",
               f"data.val_files=[{data / 'test.parquet'}]", *VLLM, *MODES[mode]]
        start = time.perf_counter()
        with open(out / "train.log", "w") as log:
            subprocess.run(cmd, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall_file.write_text(f"{time.perf_counter() - start:.1f}\n")
        (out / "command.txt").write_text(" ".join(cmd) + "\n")
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recs if "timing/step" in r]
    val = [(r["step"], v) for r in recs for k, v in r.items() if k.startswith("val/test_score/")]
    rewards = [s["reward/score/mean"] for s in steps]
    return {"rewards": rewards, "val": val, "wall": float(wall_file.read_text()),
            "first5": statistics.mean(rewards[:5]), "last5": statistics.mean(rewards[-5:]),
            "staleness": statistics.mean(s.get("rollout/staleness_mean", 0.0) for s in steps),
            "step_s": statistics.median(s["timing/step"] for s in steps[1:])}


def within_noise(a: list[float], b: list[float]) -> tuple[float, float, bool]:
    """mean(b) - mean(a), two standard errors of that difference, and whether the difference is inside them."""
    diff = statistics.mean(b) - statistics.mean(a)
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) if len(a) > 1 else float("nan")
    return diff, 2 * se, abs(diff) <= 2 * se


def curves_png(runs: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sync": "tab:blue", "one_step": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for mode, by_seed in runs.items():
        for seed, r in by_seed.items():
            ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], color=colors[mode], alpha=0.25, linewidth=0.8)
        n = min(len(r["rewards"]) for r in by_seed.values())
        mean = [statistics.mean(r["rewards"][i] for r in by_seed.values()) for i in range(n)]
        ax.plot(range(1, n + 1), mean, color=colors[mode], linewidth=2, label=f"{mode} (mean of {len(by_seed)} seeds)")
    save_reward_plot(fig, ax, png)


def page(runs: dict, args, load: float) -> str:
    seeds = args.seeds
    last = {m: [runs[m][s]["last5"] for s in seeds] for m in MODES}
    diff, band, ok = within_noise(last["sync"], last["one_step"])
    lines = ["# One step off-policy vs synchronous PPO: learning (tools/bench_async_learning.py, issue 28)", "",
             f"Command: `python tools/bench_async_learning.py --seeds {' '.join(map(str, seeds))}"
             f"{' --reuse' if args.reuse else ''}`", "",
             f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), load average "
             f"{load:.1f} at the start; {datetime.date.today()}. `make train`'s config (configs/tiny_cpu.yaml: "
             "arithmetic task, Ray layout actor/ref TP2, critic DP2, its 30 steps) with rollout.name=vllm and 2 "
             "attention heads (vLLM's CPU attention has no head dim 16); one_step adds `trainer.async_rollout=one_step` "
             "and token-level truncated IS (threshold 2). Same seed, same data and initial weights for both modes; "
             "from step 2 on one_step trains on rollouts one actor update stale, so the batches differ.", "",
             "| seed | mode | first 5 | last 5 | margin | val score (step: score) | staleness mean | step (s, median) "
             "| wall (s) |", "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for s in seeds:
        for m in MODES:
            r = runs[m][s]
            val = ", ".join(f"{st}: {v:.3f}" for st, v in r["val"])
            lines.append(f"| {s} | {m} | {r['first5']:.3f} | {r['last5']:.3f} | {r['last5'] - r['first5']:+.3f} | "
                         f"{val} | {r['staleness']:.2f} | {r['step_s']:.2f} | {r['wall']:.0f} |")
    verdict = "within noise" if ok else "NOT within noise"
    margin = {m: statistics.mean(runs[m][s]["last5"] - runs[m][s]["first5"] for s in seeds) for m in MODES}
    below = sum(runs["one_step"][s]["last5"] < runs["sync"][s]["last5"] for s in seeds)
    lines += ["", f"Mean last-5 reward: sync {statistics.mean(last['sync']):.3f}, one_step "
                  f"{statistics.mean(last['one_step']):.3f}; difference {diff:+.3f}, two standard errors "
                  f"{band:.3f}: **{verdict}**. one_step's last-5 reward is below sync's on {below} of {len(seeds)} "
                  f"seeds; mean margins (last 5 - first 5): sync {margin['sync']:+.3f}, one_step "
                  f"{margin['one_step']:+.3f}.", "",
              "![reward per step](async_learning/rewards.png)", "",
              "Thin lines: each seed; thick: the mean over seeds. Speed is measured in [async.md](async.md).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--work", default="outputs/bench_async_learning")
    p.add_argument("--out", default="docs/bench/async_learning.md")
    p.add_argument("--reuse", action="store_true", help="keep the finished runs of an earlier invocation")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    work = REPO / args.work
    data = work / "data"  # preprocessed once by the first run (the default config's arithmetic task)
    runs = {m: {} for m in MODES}
    for seed in args.seeds:
        for mode in MODES:
            r = run(work, mode, seed, data, args.reuse)
            runs[mode][seed] = r
            print(f"seed {seed} {mode}: first5 {r['first5']:.3f} last5 {r['last5']:.3f} step {r['step_s']:.2f} s "
                  f"wall {r['wall']:.0f} s", flush=True)
    (work / "runs.json").write_text(json.dumps(runs, indent=1))
    png_dir = (REPO / args.out).with_suffix("")
    png_dir.mkdir(parents=True, exist_ok=True)
    curves_png(runs, png_dir / "rewards.png")
    (REPO / args.out).write_text(page(runs, args, load))
    print(f"wrote {args.out}; then: python tools/collect_benchmarks.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
