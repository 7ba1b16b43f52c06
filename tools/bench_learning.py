"""Does the default learn? `make train`'s config (configs/tiny_cpu.yaml: the generated arithmetic task, Ray layout
actor/ref TP2, critic DP2) over several seeds: mean reward of the last 5 steps minus the first 5, validation score
before/after. Offline: per --offline-seeds seed, the initial actor writes a dump of mixed quality (the base model's
samples) and offline PPO from the same initial weights trains on it, with the offline config's correction
(token-level truncated IS, threshold 2) and without: validation score before/after. --curve-seeds: the same on a
dump that spans an online run's learning curve. Writes docs/bench/learning.md (then run
tools/collect_benchmarks.py).

    python tools/bench_learning.py --seeds 1 2 3 --offline-seeds 0 1 2 --curve-seeds 0 1 5 --out docs/bench/learning.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
OFFLINE_VARIANTS = (("token_is", ("algorithm.rollout_correction.rollout_is=token",)),
                    ("no_is", ()))
STEPS = 30  # tiny_cpu's trainer.total_training_steps; a dump run writes STEPS x 16 rows
MARGIN = 0.05  # the default's run must raise the mean reward (last 5 - first 5 steps) by more than this, every seed


def train(log_dir: Path, *overrides: str, reuse: bool = False) -> float:
    """Run and return the wall time (also kept in log_dir/wall_s); with reuse, a finished run is not redone."""
    done = log_dir / "wall_s"
    if reuse and done.is_file():
        return float(done.read_text())
    start = time.perf_counter()
    with open(log_dir.with_suffix(".log"), "w") as log:
        subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
                        "trainer.overwrite=true", f"trainer.log_dir={log_dir}", *overrides], check=True, cwd=REPO,
                       stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - start
    done.write_text(f"{wall:.1f}\n")
    return wall


def records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def curves(log_dir: Path) -> dict:
    recs = records(log_dir)
    rewards = [r["reward/score/mean"] for r in recs if "reward/score/mean" in r]
    val = [(r["step"], v) for r in recs for k, v in r.items() if k.startswith("val/test_score/")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    return {"rewards": rewards, "val": val, "first5": first, "last5": last, "margin": last - first}


def fmt(xs) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


def series(log_dir: Path, key: str) -> list[float]:
    return [r[key] for r in records(log_dir) if key in r]


def rewards_of(dump_dir: Path) -> list[float]:
    return [x for f in sorted(dump_dir.glob("*.parquet")) for x in pq.read_table(f).column("reward").to_pylist()]


def mean_logprob(path: Path) -> float:
    rows = pq.read_table(path).column("rollout_log_probs").to_pylist()
    return sum(sum(r) for r in rows) / sum(len(r) for r in rows)


def quality(rewards: list[float]) -> str:
    counts = {v: sum(1 for x in rewards if x == v) for v in sorted(set(rewards))}
    return ", ".join(f"{v:g}: {n}" for v, n in counts.items()) + f" (mean {sum(rewards) / len(rewards):.3f})"


def offline(log_dir: Path, seed: int, dump_dir: Path, extra, reuse: bool) -> tuple[float, dict]:
    """One epoch over the dump (STEPS x 16 rows), validation online (greedy) before and every 10 steps."""
    wall = train(log_dir, f"trainer.seed={seed}", "rollout.mode=offline", f"rollout.trajectory_files=[{dump_dir}]",
                 "data.train_files=[]", *extra, reuse=reuse)
    return wall, curves(log_dir)


def offline_runs(work: Path, seed: int, reuse: bool):
    """The initial actor of `seed` writes a dump (critic_warmup = all steps: the actor never changes, so every row
    comes from one behaviour policy: the offline actor's own starting point, as in "collect with the base model
    once, train offline many times"); offline runs start from the same initial weights (same trainer.seed)."""
    dump_dir = work / f"dump_init_s{seed}"
    train(work / f"dump_init_run_s{seed}", f"trainer.seed={seed}", f"data.seed={seed}",
          f"trainer.total_training_steps={STEPS}", f"trainer.critic_warmup={STEPS}", f"rollout.dump_dir={dump_dir}",
          "trainer.test_freq=-1", "trainer.val_before_train=false", reuse=reuse)
    runs = {name: offline(work / f"offline_init_{name}_s{seed}", seed, dump_dir, extra, reuse)
            for name, extra in OFFLINE_VARIANTS}
    return rewards_of(dump_dir), runs


def curve_runs(work: Path, seeds, reuse: bool):
    """The seed-0 online run's dump (its whole learning curve: the early rows from the initial actor, the later
    ones from ever more trained actors), trained offline by actors of `seeds` (0: the dumping run's own start)."""
    dump_dir = work / "dump"
    train(work / "online_dump_run", "trainer.seed=0", "data.seed=0", f"rollout.dump_dir={dump_dir}", reuse=reuse)
    runs = {(seed, name): offline(work / f"offline_curve_{name}_s{seed}", seed, dump_dir, extra, reuse)
            for seed in seeds for name, extra in OFFLINE_VARIANTS}
    return rewards_of(dump_dir), runs, work


def val_text(c: dict) -> str:
    return ", ".join(f"{s}: {v:.3f}" for s, v in c["val"])


def rises(c: dict) -> bool:
    return c["val"][-1][1] > c["val"][0][1]


def offline_section(offline: dict, args) -> list[str]:
    if not offline:
        return []
    lines = ["", "### Offline", "",
             "The realistic offline case (verl's rollout correction, the off-policy PPO papers): trajectories "
             "collected once with the base model, then trained on offline, starting from that same base model. "
             f"Per seed s: the initial actor of `trainer.seed=s` writes {STEPS} x 16 rows (`rollout.dump_dir`, "
             f"`trainer.critic_warmup={STEPS}` so the actor never changes while dumping; temperature 1, so the rows "
             "are of mixed quality: rewards 0 (no number), 0.2 (a wrong number) and 1 (the right one)); then "
             "`rollout.mode=offline rollout.trajectory_files=[dump]` from the same initial weights "
             "(`trainer.seed=s`), one epoch over the dump (30 steps of 16 rows), validation online (greedy, 32 test "
             "prompts) before training and every 10 steps. token_is is configs/gsm8k_offline.yaml's correction "
             "(token-level truncated IS, threshold 2.0, `algorithm.rollout_correction.rollout_is=token`); no_is "
             "turns rollout correction off. At step 1 the IS weights are exactly 1 (behaviour = current actor); "
             "they move as the actor learns.", "",
             "| seed | dump rewards (rows) | offline run | val score (step: score) | IS weight mean, step 1 -> 30 | "
             "entropy, step 1 -> 30 | wall (s) |", "| ---: | --- | --- | --- | --- | --- | ---: |"]
    for seed, (dumped, runs) in offline.items():
        for name, (wall, c) in runs.items():
            d = args_work(args) / f"offline_init_{name}_s{seed}"
            w = series(d, "rollout_corr/rollout_is_mean")
            ent = series(d, "actor/entropy")
            lines.append(f"| {seed} | {quality(dumped)} | {name} | {val_text(c)} | "
                         f"{f'{w[0]:.2f} -> {w[-1]:.2f}' if w else '-'} | {ent[0]:.2f} -> {ent[-1]:.2f} | {wall:.0f} |")
    lines.append("")
    for name, _ in OFFLINE_VARIANTS:
        got = [(seed, runs[name][1]) for seed, (_, runs) in offline.items()]
        up = [seed for seed, c in got if rises(c)]
        lines.append(f"- {name}: the validation score rises (last > before training) for {len(up)} of {len(got)} "
                     f"seeds ({before_after(got)})")
    weights = [series(args_work(args) / f"offline_init_token_is_s{seed}", "rollout_corr/rollout_is_mean")[-1]
               for seed in offline]
    lines += ["", "The validation score is coarse: the mean over 32 greedy answers of 0 (no number), 0.2 (a wrong "
              "number) or 1 (the right one); 0.200 is, e.g., a number in every answer and none right. By the last "
              f"step the token-IS runs' mean IS weight is {min(weights):.2f}-{max(weights):.2f}: the actor has "
              "moved away from the behaviour policy as it learned, and the weights shrink the updates on the rows "
              "it now finds unlikely.", "",
              "Validation score per step (step 0 = before training):", ""]
    lines += [f"- seed {seed} {name}: {val_text(c)}" for seed, (_, runs) in offline.items()
              for name, (_, c) in runs.items()]
    return lines


def before_after(got) -> str:
    return ", ".join(f"seed {s}: {c['val'][0][1]:.3f} -> {c['val'][-1][1]:.3f}" for s, c in got)


def args_work(args) -> Path:
    return (REPO / args.work).resolve()


def curve_section(dumped: list[float], runs: dict, work: Path) -> list[str]:
    mean = sum(dumped) / len(dumped)
    below = sum(1 for x in dumped if 0 < x < mean)
    files = sorted((work / "dump").glob("*.parquet"))
    first_lp, last_lp = (mean_logprob(f) for f in (files[0], files[-1]))
    lines = ["", "#### A dump that spans a learning curve (the earlier setting)", "",
             f"The seed-0 online run's own dump: rewards {quality(dumped)}; its early rows come from the initial "
             "actor, the later ones from ever more trained actors (mean behaviour log-prob per token "
             f"{first_lp:.2f} in the first step's rows, {last_lp:.2f} in the last step's). Offline runs as above, "
             f"from the dumping run's own initial weights (seed 0) and from other initial actors (seeds "
             f"{', '.join(str(seed) for seed in dict.fromkeys(seed for seed, _ in runs) if seed != 0)}).", "",
             "| actor seed | offline run | val score (step: score) | IS weight mean, step 1 -> 30 | "
             "entropy, step 1 -> 30 | wall (s) |", "| ---: | --- | --- | --- | --- | ---: |"]
    for (seed, name), (wall, c) in runs.items():
        d = work / f"offline_curve_{name}_s{seed}"
        w, ent = series(d, "rollout_corr/rollout_is_mean"), series(d, "actor/entropy")
        lines.append(f"| {seed} | {name} | {val_text(c)} | {f'{w[0]:.2f} -> {w[-1]:.2f}' if w else '-'} | "
                     f"{ent[0]:.2f} -> {ent[-1]:.2f} | {wall:.0f} |")
    outcomes = {k: rises(c) for k, (_, c) in runs.items()}
    seeds = sorted({seed for seed, _ in runs})
    same = all(outcomes[(seed, "token_is")] == outcomes[(seed, "no_is")] for seed in seeds)
    lines += ["", f"Here the validation score rises in {sum(outcomes.values())} of {len(outcomes)} runs ("
              + ", ".join(f"seed {s} {n}: {'rises' if r else 'does not rise'}" for (s, n), r in outcomes.items())
              + ("); for each actor seed, token IS and no correction end alike" if same else
                 "); token IS and no correction differ for some seeds, and the outcome changes with the seed")
              + f". The dump's mean reward is {mean:.3f}: {below} of its {len(dumped)} rows have a reward above 0 "
              "but below that mean" + (
                  " (a wrong number, 0.2: the first thing a random actor must learn is to write a number at all). "
                  "The critic learns the dump's value, so the whitened advantages of those rows are negative and "
                  "only the few right answers push up; the actor is pushed away from most of the data (its "
                  "log-likelihood of the dumped tokens falls, rollout_corr/training_log_ppl in metrics.jsonl) and its "
                  "entropy collapses onto whatever token it drifts to. Whether the greedy answer then holds a digit "
                  "depends on the seed more than on the correction. In the base-model dump above, the same rows "
                  "are above the dump's mean reward." if below else ".")]
    return lines


def main() -> None:
    if "--model" in sys.argv:  # a real pretrained model: its own runner and page (tools/bench_learning_smollm2.py)
        i = sys.argv.index("--model")
        if sys.argv[i + 1:i + 2] != ["smollm2"]:
            sys.exit("bench_learning.py: --model takes smollm2 (SmolLM2-135M-Instruct)")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_learning_smollm2 import main as smollm2_main

        smollm2_main(sys.argv[1:i] + sys.argv[i + 2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--work", default="outputs/bench_learning")
    p.add_argument("--out", default="docs/bench/learning.md")
    p.add_argument("--offline-seeds", type=int, nargs="*", default=[0, 1, 2],
                   help="offline: per seed, the initial actor of that seed writes a dump, then offline runs start "
                        "from the same initial weights")
    p.add_argument("--curve-seeds", type=int, nargs="*", default=[0, 1, 5],
                   help="offline on the seed-0 online run's dump (its whole learning curve), actors of these seeds "
                        "(empty: skip)")
    p.add_argument("--reuse", action="store_true", help="keep runs of an earlier pass that finished (their wall_s)")
    args = p.parse_args()
    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    rows = []
    for seed in args.seeds:
        d = work / f"seed{seed}"
        wall = train(d, f"trainer.seed={seed}", f"data.seed={seed}", reuse=args.reuse)
        rows.append((seed, wall, curves(d)))
        print(f"seed {seed}: margin {rows[-1][2]['margin']:+.3f} in {wall:.0f} s", flush=True)
    offline = {s: offline_runs(work, s, args.reuse) for s in args.offline_seeds}
    curve = curve_runs(work, args.curve_seeds, args.reuse) if args.curve_seeds else None

    margins = [c["margin"] for _, _, c in rows]
    lines = [
        "# Learning: the default's reward rises; offline PPO on a dump raises the validation score (issue 13)", "",
        "Produced by `tools/bench_learning.py`: `make train`'s config (configs/tiny_cpu.yaml: the generated arithmetic "
        "task of `megatron-ppo preprocess arithmetic`, GSM8K format, scored by the GSM8K rule reward in numeric mode "
        "with format_score 0.2; 2-layer 64-wide random model, 300-token BPE; Ray, actor/ref TP2, critic DP2), "
        "one fresh process per run. Margin = mean reward of the last 5 steps minus the first 5. "
        f"**Bar: every seed's margin > {MARGIN}.** Design: [../trainer.md](../trainer.md).", "",
        f"Command: `python tools/bench_learning.py --seeds {' '.join(map(str, args.seeds))} --offline-seeds "
        f"{' '.join(map(str, args.offline_seeds))} --curve-seeds {' '.join(map(str, args.curve_seeds))} "
        f"--out {args.out}`", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (load average {load:.1f} at the start); "
        f"{datetime.date.today()}." + (" Runs kept from earlier passes (--reuse) show the wall time measured then; the "
        "machine was shared with other jobs (load averages from about 2 to over 100 during these runs), so wall times "
        "vary with the load, not with the setting." if args.reuse else ""), "",
        "| seed | first 5 | last 5 | margin | val score (step: score) | wall (s) |",
        "| ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for seed, wall, c in rows:
        val = ", ".join(f"{s}: {v:.3f}" for s, v in c["val"])
        lines.append(f"| {seed} | {c['first5']:.3f} | {c['last5']:.3f} | {c['margin']:+.3f} | {val} | {wall:.0f} |")
    lines += ["", f"Smallest margin {min(margins):+.3f} ({'clears' if min(margins) > MARGIN else 'MISSES'} the "
              f"bar {MARGIN}); mean {sum(margins) / len(margins):+.3f}.", "", "Reward per step:", ""]
    lines += [f"- seed {seed}: {fmt(c['rewards'])}" for seed, _, c in rows]
    lines += offline_section(offline, args)
    if curve is not None:
        lines += curve_section(*curve)
    (REPO / args.out).write_text("\n".join(lines) + "\n")
    vals = "; ".join(f"seed {s} {n}: {c['val']}" for s, (_, runs) in offline.items() for n, (_, c) in runs.items())
    print(f"{args.out}: margins {fmt(margins)}; offline val {vals}")


if __name__ == "__main__":
    main()
