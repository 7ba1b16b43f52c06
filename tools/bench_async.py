"""Does overlapping rollout and training pay? `trainer.async_rollout=one_step` against synchronous PPO on the same
model, data and CPUs: SmolLM2-135M-Instruct (configs/smollm2_gsm8k.yaml) on the arithmetic task, rollout.name=vllm.

Layouts, each a `megatron-ppo train` run of ``--steps`` steps (step 1, which starts the engine, is left out of the
medians):
- ``sync``: synchronous, the engine and the training share every core (vLLM's own thread binding);
- ``sync_split``: synchronous, the engine on core 0 (rollout.vllm.cpu_threads_bind=0), the training on the other
  cores (the train process and its Ray ranks under `taskset`, cluster.num_cpus_per_rank=1);
- ``one_step``: one step off-policy, split as ``sync_split``: the engine generates step k+1 on core 0 while step k
  trains on the others; token-level truncated IS (threshold 2) corrects the one-update-stale rollout;
- ``one_step_shared``: one step off-policy, the engine and the training sharing every core (the OS time-slices them).

Writes docs/bench/async.md: step time, tokens/s and the ratio of the fastest one-step layout to the fastest synchronous
one (goal <= 0.75), the phases per step as a Gantt chart (PNG) and the reward curves overlaid, with the command.

    python tools/bench_async.py --steps 8
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from bench_learning_smollm2 import ARITH_OVERRIDES, ARITH_TRAIN, MODEL  # noqa: E402

IS_TOKEN = ("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0")
SPLIT = ("rollout.vllm.cpu_threads_bind=0", "cluster.num_cpus_per_rank=1")
ONE_STEP = ("trainer.async_rollout=one_step",) + IS_TOKEN
LAYOUTS = {"sync": (), "sync_split": SPLIT, "one_step": SPLIT + ONE_STEP, "one_step_shared": ONE_STEP}
SYNC = ("sync", "sync_split")
# the phases of a step in the order the driver runs them (trainer/ppo.py); gen_submit/gen_wait only in one_step
PHASES = ("gen", "gen_submit", "reward", "old_log_prob", "adv", "update_critic", "update_actor", "gen_wait",
          "sync_weights")
COLORS = {"gen": "tab:blue", "gen_submit": "tab:cyan", "reward": "tab:olive", "old_log_prob": "tab:purple",
          "adv": "tab:gray", "update_critic": "tab:orange", "update_actor": "tab:red", "gen_wait": "tab:pink",
          "sync_weights": "tab:green", "rollout in flight": "tab:blue"}


def train_cores() -> str | None:
    """The cores the training gets in a split layout: every core but 0 (None on a 1-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cores[1:])) if len(cores) > 1 else None


def run(work: Path, name: str, steps: int, data: Path, seed: int, reuse: bool = False) -> list[dict]:
    out = work / name
    metrics = out / "logs" / "metrics.jsonl"
    if reuse and (out / "command.txt").is_file() and metrics.is_file():  # a finished run of an earlier invocation
        rows = [r for r in map(json.loads, metrics.open()) if "timing/step" in r]
        if len(rows) == steps:
            return rows
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "smollm2_gsm8k", "trainer.overwrite=true",
           "rollout.name=vllm", f"rollout.vllm.weights_dir={out / 'shm'}", f"trainer.total_training_steps={steps}",
           "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.seed={seed}",
           f"trainer.log_dir={out / 'logs'}", f"trainer.default_local_dir={out / 'ckpt'}",
           f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]",
           "data.preprocess.dataset=null", *ARITH_OVERRIDES, *ARITH_TRAIN, *LAYOUTS[name]]
    if "cpu_threads_bind=0" in " ".join(LAYOUTS[name]) and train_cores():
        cmd = ["taskset", "-c", train_cores()] + cmd
    start = time.perf_counter()
    with open(out / "train.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (out / "command.txt").write_text(" ".join(cmd) + f"\n# wall {time.perf_counter() - start:.1f} s\n")
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").open()]
    return [r for r in rows if "timing/step" in r]


def summary(steps: list[dict]) -> dict:
    timed = steps[1:] or steps  # step 1 starts the engine
    med = lambda key: statistics.median(s.get(key, 0.0) for s in timed)  # noqa: E731
    return {"step_s": med("timing/step"), "tokens_per_s": med("perf/tokens_per_s"),
            "phases": {p: med(f"timing/{p}") for p in PHASES},
            "reward": [s["reward/score/mean"] for s in steps],
            "staleness": med("rollout/staleness_mean") if "rollout/staleness_mean" in timed[0] else 0.0,
            "steps": len(steps)}


def gantt(runs: dict[str, list[dict]], png: Path) -> None:
    """One lane per layout (and a rollout lane for one_step: the next step's generation from its submit to its
    collect), the phases of steps 2.. laid end to end as the driver ran them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = []
    for name, steps in runs.items():
        t, bars, flight = 0.0, [], []
        for s in steps[1:]:
            submit = None
            for p in PHASES:
                d = s.get(f"timing/{p}")
                if d is None:
                    continue
                bars.append((t, d, p))
                if p == "gen_submit":
                    submit = t + d
                if p == "gen_wait" and submit is not None:
                    flight.append((submit, t + d - submit, "rollout in flight"))
                t += d
            t = max(t, sum(bars[-1][:2]) if bars else t)
        lanes.append((name, bars))
        if flight:
            lanes.append((f"{name}: next rollout", flight))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(lanes)))
    seen = set()
    for i, (label, bars) in enumerate(lanes):
        for start, width, phase in bars:
            ax.barh(i, width, left=start, color=COLORS[phase], edgecolor="white", linewidth=0.3,
                    label=phase if phase not in seen else None)
            seen.add(phase)
    ax.set_yticks(range(len(lanes)), [label for label, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the end of step 1")
    ax.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def rewards_png(runs: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, steps in runs.items():
        ax.plot([s["step"] for s in steps], [s["reward/score/mean"] for s in steps], marker="o", label=name)
    save_reward_plot(fig, ax, png)


def save_reward_plot(fig, ax, png: Path) -> None:
    """Label a reward-per-step plot and write it (also tools/bench_async_learning.py)."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("step")
    ax.set_ylabel("reward/score/mean")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def page(results: dict, args, load: float, png_dir: Path) -> str:
    best = min(SYNC, key=lambda n: results[n]["step_s"])
    ones = [n for n in results if n not in SYNC]
    fastest = min(ones, key=lambda n: results[n]["step_s"])
    ratio = results[fastest]["step_s"] / results[best]["step_s"]
    lines = ["## One step off-policy vs synchronous PPO (tools/bench_async.py, issue 28)", "",
             f"Command: `python tools/bench_async.py --steps {args.steps} --seed {args.seed}"
             f"{' --reuse' if args.reuse else ''}`", "",
             f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), load average "
             f"{load:.1f} at the start; {datetime.date.today()}. SmolLM2-135M-Instruct (configs/smollm2_gsm8k.yaml) "
             f"on the arithmetic task ({' '.join(ARITH_TRAIN[5:8])}, {ARITH_OVERRIDES[0]}), rollout.name=vllm; "
             f"medians of steps 2-{args.steps} (step 1 starts the engine). The layouts ran one after the other on "
             "this machine (`--reuse`: the finished ones of an earlier invocation are kept).", "",
             "| layout | step (s) | tokens/s | gen | gen_wait | old_log_prob | update_critic | update_actor | "
             "sync_weights | staleness |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        p = r["phases"]
        lines.append(f"| {name} | {r['step_s']:.1f} | {r['tokens_per_s']:.0f} | {p['gen']:.1f} | {p['gen_wait']:.1f} "
                     f"| {p['old_log_prob']:.1f} | {p['update_critic']:.1f} | {p['update_actor']:.1f} | "
                     f"{p['sync_weights']:.2f} | {r['staleness']:.0f} |")
    lines += ["", f"**Fastest one step off-policy layout ({fastest}) / fastest synchronous layout ({best}): {ratio:.2f}x** "
              "step time (goal <= 0.75x).", "",
              f"![phases per step](async/gantt.png)", "",
              "The next rollout's lane runs from its submit to its collect: the engine finished somewhere inside it, "
              "and `gen_wait` is the part the training did not hide.", "",
              f"![reward per step](async/rewards.png)", "",
              "Learning over 30 steps and 3 seeds (sync vs one_step): [async_learning.md](async_learning.md).", "",
              "Rewards per step: " + "; ".join(f"{n}: {', '.join(f'{v:.2f}' for v in r['reward'])}"
                                                for n, r in results.items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work", default="outputs/bench_async")
    p.add_argument("--out", default="docs/bench/async.md")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--reuse", action="store_true", help="keep the finished runs of an earlier invocation")
    args = p.parse_args(argv)
    from megatron_ppo.convert.gguf import ensure_hf_dir
    from megatron_ppo.data.preprocess import preprocess_arithmetic

    load = os.getloadavg()[0]
    work = REPO / args.work
    ensure_hf_dir(MODEL)
    data = work / "arithmetic_data"
    if not (data / "test.parquet").is_file():
        preprocess_arithmetic(data, train_rows=4096, test_rows=256, seed=0, level="multi")
    runs = {name: run(work, name, args.steps, data, args.seed, args.reuse) for name in args.layouts}
    (work / "runs.json").write_text(json.dumps(runs, indent=1))
    results = {name: summary(steps) for name, steps in runs.items()}
    for name, r in results.items():
        print(f"{name}: step {r['step_s']:.1f} s, {r['tokens_per_s']:.0f} tokens/s, phases "
              f"{ {k: round(v, 2) for k, v in r['phases'].items()} }")
    if set(args.layouts) == set(LAYOUTS):
        png_dir = (REPO / args.out).with_suffix("")
        png_dir.mkdir(parents=True, exist_ok=True)
        gantt(runs, png_dir / "gantt.png")
        rewards_png(runs, png_dir / "rewards.png")
        (REPO / args.out).write_text(page(results, args, load, png_dir))
        print(f"wrote {args.out}; then: python tools/collect_benchmarks.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
