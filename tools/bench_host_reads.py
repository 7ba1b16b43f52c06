"""Host reads outside generation: per PPO step of the tiny default, by phase and by depth (2 vs 4 layers), and per
packed micro-batch (forward, or forward + backward).

    python tools/bench_host_reads.py --out docs/bench/host_reads.md [--baseline before.json --baseline-label X]

(``before.json``: ``--json`` of the same script run in another checkout, e.g. the commit before a change, with
``PYTHONPATH`` set to that checkout.)

A host read (``megatron_ppo.testing.host_reads``: ``item``, ``tolist``, ``bool(t)``, ``torch.equal``, boolean-mask
indexing, ...) is free on a CPU and drains the stream on a GPU. Counted in-process (``cluster.launcher=local``, one
rank per role, all in this thread) inside the workers' device-side calls (``MegatronWorker.forward`` and
``train_step``: micro-batches on the model's device, every loss and metric, the optimizer step); the driver's and the
role workers' bookkeeping on CPU tensors is not a device read and is not counted, nor is generation (its own budget:
docs/bench/rollout.md).
The ``--sites`` listing names the lines that read, which is how a regression is found.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("reward", "old_log_prob", "adv", "update_critic", "update_actor")


def run_steps(layers: int, steps: int, out_dir: str, sites: bool) -> dict:
    """``steps`` PPO steps of configs/tiny_cpu.yaml at ``layers`` layers; host reads of the last one by phase."""
    from megatron_ppo.config import load_config, to_yaml
    from megatron_ppo.testing.host_reads import WorkerCalls
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer
    from megatron_ppo.trainer.tracking import claim_log_dir

    over = ["cluster.launcher=local", "cluster.n_gpus_per_node=1", "cluster.actor.tensor_model_parallel_size=1",
            "cluster.ref.tensor_model_parallel_size=1", f"actor.model.arch.num_layers={layers}",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "trainer.logger=[jsonl]", f"trainer.log_dir={out_dir}/logs", "trainer.overwrite=true",
            f"trainer.default_local_dir={out_dir}/ckpt"]
    cfg = load_config("tiny_cpu", over)
    claim_log_dir(cfg.trainer, to_yaml(cfg))
    calls = WorkerCalls(where=sites)
    counter = calls.counter
    per_phase: dict[str, int] = {}

    class CountingTrainer(PPOTrainer):
        def next_rollout(self):
            with counter.paused():
                return super().next_rollout()

    def phase(name, method):
        def run(*args, **kwargs):
            before = counter.total
            try:
                return method(*args, **kwargs)
            finally:
                per_phase[name] = per_phase.get(name, 0) + counter.total - before
        return run

    methods = {"reward": "score", "old_log_prob": "evaluate", "adv": "compute_advantages"}
    parts = build_components(cfg)
    try:
        trainer = CountingTrainer(cfg, parts)
        for name in PHASES:
            attr = methods.get(name, name)
            setattr(trainer, attr, phase(name, getattr(trainer, attr)))
        with calls:
            trainer.fit(steps - 1)  # warm-up steps (first-call paths: allocator, caches)
            per_phase.clear()
            calls.reset()
            trainer.fit(steps)
    finally:
        parts.close()
    return {"layers": layers, "total": counter.total, "micro_batches": calls.totals()["micro_batches"],
            "by_name": dict(counter.by_name), "phases": per_phase,
            "sites": dict(sorted(counter.sites.items(), key=lambda kv: -kv[1])[:25]) if sites else {}}


def render(rows: list[dict], command: str, baseline: list[dict] = (), baseline_label: str = "") -> str:
    lines = ["# Host reads outside generation (issue 47)", "",
             "One PPO step of the tiny default (configs/tiny_cpu.yaml, in-process ranks: TP = PP = DP = 1 per "
             "role) after a warm-up step, counted by `megatron_ppo.testing.host_reads.HostReadCounter` inside the "
             "workers' device-side calls (`MegatronWorker.forward` / `train_step`: every forward, loss, backward, "
             "metric and optimizer step of every role; generation and the driver's CPU bookkeeping excluded). A host "
             "read is a call after which the host holds a device value (`item`, `tolist`, `bool(t)`, `int(t)`, "
             "`torch.equal`, boolean indexing, ...): a stream drain on a GPU. torch.optim's CPU step counters are "
             "not counted.", "",
             f"Command: `{command}`", ""]
    if baseline:
        lines += [f"Baseline rows: this script's `--json` run in a checkout of {baseline_label} (`git worktree add`, "
                  "`PYTHONPATH=<checkout>`; `megatron_ppo/testing/host_reads.py` and this script copied in), "
                  "passed as `--baseline`.", ""]
    lines += [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}.", "",
              "| code | layers | total | micro-batches | per micro-batch | " + " | ".join(PHASES) + " | by call |",
              "|---|---|---|---|---|" + "---|" * len(PHASES) + "---|"]
    for label, r in [(baseline_label, b) for b in baseline] + [("this tree", r) for r in rows]:
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["by_name"].items(), key=lambda kv: -kv[1]))
        per = r["total"] / max(r["micro_batches"], 1)
        lines.append(f"| {label} | {r['layers']} | {r['total']} | {r['micro_batches']} | {per:.1f} | " + " | ".join(str(r["phases"].get(p, 0)) for p in PHASES)
                     + f" | {calls} |")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        growth = (b["total"] - a["total"]) / (b["layers"] - a["layers"])
        lines += ["", f"Growth with depth: {growth:+.1f} host reads per added layer per step."]
    if len(baseline) >= 2:
        a, b = baseline[0], baseline[-1]
        lines += [f"{baseline_label}: {(b['total'] - a['total']) / (b['layers'] - a['layers']):+.1f} per added layer."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=2, help="steps run; the last one is counted")
    ap.add_argument("--sites", action="store_true", help="print the 25 lines that read most")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--json", help="write the raw counts here")
    ap.add_argument("--baseline", help="a --json of another tree's run, shown above this one's rows")
    ap.add_argument("--baseline-label", default="baseline", help="what the baseline rows are (e.g. a commit)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=REPO / "outputs" if (REPO / "outputs").is_dir() else None) as tmp:
        for layers in args.layers:
            rows.append(run_steps(layers, args.steps, tmp, args.sites))
            if args.sites:
                print(f"-- {layers} layers: {rows[-1]['total']} reads", file=sys.stderr)
                for site, n in rows[-1]["sites"].items():
                    print(f"{n:6d}  {site}", file=sys.stderr)
    command = "python tools/bench_host_reads.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else []
    text = render(rows, command.strip(), baseline, args.baseline_label)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
