"""What the always-on phase ranges cost (megatron_ppo/profiling.py, issue 50's <= 1 % of a step): the time of one
``phase_range`` enter + exit outside any profile (interleaved with a bare ``nullcontext`` baseline), times the
ranges one step opens, over the step's time. The ranges and the step time come from a real profiled step of the
tiny default (``megatron-ppo train`` with launcher=local and global_profiler.tool=torch on step 2): every event of
the driver's trace whose name is one of ours (``ppo/``, ``<role>/``). Writes docs/bench/profiling.md.

    python tools/bench_profiling.py [--reps 200000]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = ("ppo/", "actor/", "critic/", "ref/", "reward/")


def range_cost(reps: int) -> tuple[float, float]:
    """Seconds per enter + exit: phase_range, and a bare nullcontext (the loop's own cost), interleaved."""
    from megatron_ppo.profiling import phase_range

    best = {"range": float("inf"), "bare": float("inf")}
    for _ in range(5):
        for name, ctx in (("range", lambda: phase_range("ppo/bench")), ("bare", contextlib.nullcontext)):
            start = time.perf_counter()
            for _ in range(reps):
                with ctx():
                    pass
            best[name] = min(best[name], (time.perf_counter() - start) / reps)
    return best["range"], best["bare"]


def profiled_step() -> dict:
    """A 2-step tiny run profiling step 2: our ranges in its trace, and its step time."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "megatron_ppo.cli", "train", "cluster.launcher=local",
               "cluster.actor.tensor_model_parallel_size=1", "cluster.ref.tensor_model_parallel_size=1",
               "cluster.critic.data_parallel_size=1", "cluster.actor.data_parallel_size=1",
               "cluster.ref.data_parallel_size=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
               "trainer.total_training_steps=3", f"trainer.log_dir={tmp}/logs", "global_profiler.tool=torch",
               "global_profiler.steps=[2]"]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True, timeout=900)
        events = json.loads((Path(tmp) / "logs/profile/step2/driver.pt.trace.json").read_text())["traceEvents"]
        steps = [json.loads(line) for line in open(f"{tmp}/logs/metrics.jsonl")]
    ours = [e["name"] for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(OURS)]
    return {"ranges": len(ours), "distinct": sorted(set(ours)), "step_s": [s["timing/step"] for s in steps],
            "command": " ".join(cmd[3:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200_000)
    args = ap.parse_args()
    rng, bare = range_cost(args.reps)
    step = profiled_step()
    per_range = max(rng - bare, 0.0)
    unprofiled = [s for i, s in enumerate(step["step_s"]) if i != 1]  # steps 1 and 3: no profiler running
    share = step["ranges"] * per_range / min(unprofiled)
    lines = [
        "## Phase ranges: what staying on costs (tools/bench_profiling.py)", "",
        f"Command: `python tools/bench_profiling.py --reps {args.reps}` (CPU, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}). The ranges of one step are those of step 2 of `megatron-ppo {step['command']}` "
        "(the tiny default, in-process ranks): every event of the driver's trace named `ppo/...` or `<role>/...`.",
        "", "| quantity | value |", "|---|---|",
        f"| one `phase_range` enter + exit, no profiler running (best of 5 x {args.reps}) | {rng * 1e6:.2f} us |",
        f"| a bare `nullcontext` (the loop's own cost) | {bare * 1e6:.2f} us |",
        f"| ranges one step opens | {step['ranges']} ({len(step['distinct'])} names) |",
        f"| step time without a profiler (steps 1, 3) | {', '.join(f'{s:.2f}' for s in unprofiled)} s |",
        f"| ranges x (range - bare) / fastest unprofiled step | **{share:.4%}** (goal <= 1 %) |", "",
        "On a GPU each range also pushes and pops an NVTX range (not measured here: no GPU was lent), with the same "
        "count per step. A GPU step is shorter than this CPU one, so the share grows with it; the GPU check's "
        "ppo_step stage is where to measure it.", "",
        f"Names seen: {', '.join(f'`{n}`' for n in step['distinct'])}.", ""]
    text = "\n".join(lines)
    (REPO / "docs" / "bench" / "profiling.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
