"""Weight export for a rollout engine with its own copy (rollout/weights.py): seconds to write the actor's weights
under HF names as versioned safetensors buckets (write_weights + finish_sync) and to read them back (what an engine
loads), SmolLM2-135M-Instruct in fp32, TP1, to /dev/shm (the CPU hand-over path). Writes docs/bench/rollout.md.

    python tools/bench_weight_sync.py [--reps 5] [--bucket-mb 512] [--dir /dev/shm]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


def run(args) -> dict:
    import torch

    from bench_generation import smollm2_hf_dir
    from megatron_ppo import parallel
    from megatron_ppo.convert.hf_import import load_hf_weights
    from megatron_ppo.convert.mapping import arch_from_hf_config
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout.weights import finish_sync, read_weights, write_weights

    hf_dir = str(smollm2_hf_dir())
    parallel.initialize(tp=1, pp=1, seed=1)
    arch = arch_from_hf_config(hf_dir)
    model = build_gpt_model(arch, "actor")
    load_hf_weights(model, "actor", hf_dir, str(REPO / "build" / "mcore-cache"))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    write_s, read_s = [], []
    for version in range(1, args.reps + 1):
        out = tempfile.mkdtemp(prefix="weight-sync-", dir=args.dir)
        try:
            start = time.perf_counter()
            files = write_weights(model, out, version, bucket_bytes=args.bucket_mb << 20)
            finish_sync(out, version, files, arch)
            write_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            tensors, _ = read_weights(out, version)
            read_s.append(time.perf_counter() - start)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return {"params_bytes": nbytes, "files": len(files), "tensors": len(tensors), "write_s": write_s,
            "read_s": read_s, "threads": torch.get_num_threads(), "load": os.getloadavg(),
            "command": "python tools/bench_weight_sync.py " + " ".join(sys.argv[1:])}


def markdown(r: dict) -> str:
    gb = r["params_bytes"] / 1e9
    w, rd = statistics.median(r["write_s"]), statistics.median(r["read_s"])
    return "\n".join([
        "## Rollout weight export (tools/bench_weight_sync.py)", "",
        f"Command: `{r['command']}`. SmolLM2-135M-Instruct, fp32 ({gb:.2f} GB of parameters), TP1, "
        f"{r['threads']} torch threads, load {r['load'][0]:.1f}; median of {len(r['write_s'])} repetitions.", "",
        "| phase | seconds | GB/s |", "|---|---|---|",
        f"| export: gather + HF mapping + safetensors buckets + manifest (`write_weights` + `finish_sync`) | "
        f"{w:.3f} | {gb / w:.2f} |",
        f"| read back ({r['tensors']} HF tensors, {r['files']} file(s); what an engine loads) | {rd:.3f} | "
        f"{gb / rd:.2f} |", "",
        "The goal of issue 25 (weight sync <= 10% of the PPO step at 135M on CPU) needs the engine's own load "
        "(vLLM `reload_weights`) on top of the export; pending with the engine.", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()
    r = run(args)
    text = markdown(r)
    (REPO / "docs" / "bench" / "rollout.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
