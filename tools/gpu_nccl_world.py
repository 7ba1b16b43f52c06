#!/usr/bin/env python
"""An NCCL world of 2 processes on the one GPU (tools/gpu_check.sh, stage nccl), through the product's launcher
(megatron_ppo.parallel.launch.LocalWorkerPool: spawned ranks, torchrun-style env, init_process_group("nccl")).

Both ranks select cuda:0 and all-reduce, all-gather and broadcast; where that works, the vocab-parallel
log-prob op runs over the 2-rank NCCL group (ops.token_logprobs_entropy with tp_group) against the full-vocabulary
result. NCCL normally refuses two ranks of one communicator on one device ("Duplicate GPU detected": each rank
must own a GPU); that outcome is recorded with NCCL's own message and reported as a skip with the reason, any other
failure as a failure.

    python tools/gpu_nccl_world.py --out nccl.json            # exit 0: ran; 77: NCCL refused (reason printed)
    python tools/gpu_nccl_world.py --dry-run                  # the CPU side: both jobs in a gloo world of one
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SKIP = 77
REFUSAL_MARKERS = ("Duplicate GPU detected", "ncclInvalidUsage")


def _collectives(rank: int, world: int) -> dict:
    """All-reduce, all-gather and broadcast on this rank's device; returns what each gave."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # both ranks: the machine has one GPU
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    gathered = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device=device))
    b = torch.full((3,), float(rank + 10), device=device)
    dist.broadcast(b, src=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"rank": rank, "device": str(device), "backend": dist.get_backend(),
            "all_reduce": x.tolist(), "all_gather": [g.tolist() for g in gathered], "broadcast": b.tolist()}


def _vocab_parallel_logprobs(rank: int, world: int) -> dict:
    """The TP log-prob op over the world's group: each rank holds one vocabulary shard."""
    import torch
    import torch.distributed as dist

    from megatron_ppo import ops

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    vocab = 2 * 4099
    logits = torch.randn(6, vocab, generator=g)
    target = torch.randint(0, vocab, (6,), generator=g)
    shard = vocab // world
    mine = logits[:, rank * shard:(rank + 1) * shard].to(device)
    lp, ent = ops.token_logprobs_entropy(mine, target.to(device), vocab_start_index=rank * shard,
                                         tp_group=dist.group.WORLD)
    full_lp, full_ent = ops.token_logprobs_entropy(logits.to(device), target.to(device))
    return {"rank": rank, "ops_backend": ops.backend(device),
            "max_abs_diff": max((lp - full_lp).abs().max().item(), (ent - full_ent).abs().max().item())}


def classify(error_text: str) -> tuple[str, str | None]:
    """("refused", why) when NCCL refused two ranks on one device, else ("failed", None)."""
    refused = next((m for m in REFUSAL_MARKERS if m in error_text), None)
    if refused is None:
        return "failed", None
    lines = [ln.strip() for ln in error_text.splitlines() if "Duplicate GPU" in ln] or [
        ln.strip() for ln in error_text.splitlines() if refused in ln]
    return "refused", f"NCCL refuses two ranks of one communicator on one GPU: {(lines or [refused])[-1][:300]}"


def run(world: int = 2, timeout: float = 30.0) -> dict:
    import tempfile

    import torch

    from megatron_ppo.parallel.launch import LocalWorkerPool

    # NCCL's own words, from every rank, into files this process reads: a rank that aborts instead of raising
    # leaves no traceback, but its refusal is still classified (and printed).
    debug_dir = tempfile.mkdtemp(prefix="nccl_debug_")
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    os.environ.setdefault("NCCL_DEBUG_FILE", os.path.join(debug_dir, "nccl.%h.%p.log"))

    out = {"world_size": world, "cuda": torch.cuda.is_available(),
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if torch.cuda.is_available():
        try:
            out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out["nccl_version"] = f"unknown ({exc})"
    start = time.perf_counter()
    try:
        with LocalWorkerPool(world, start_timeout=timeout) as pool:
            out["collectives"] = pool.run(_collectives, timeout=timeout)
            expected = float(sum(range(1, world + 1)))
            ok = all(r["all_reduce"] == [expected] * 4 and r["broadcast"] == [10.0] * 3
                     and r["all_gather"] == [[float(i)] * 2 for i in range(world)] for r in out["collectives"])
            if not ok:
                raise AssertionError(f"wrong collective results: {out['collectives']}")
            out["vocab_parallel_logprobs"] = pool.run(_vocab_parallel_logprobs, timeout=timeout)
            worst = max(r["max_abs_diff"] for r in out["vocab_parallel_logprobs"])
            if worst > 1e-4:
                raise AssertionError(f"vocab-parallel log-probs differ from the full op by {worst}")
        out["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        text = f"{type(exc).__name__}: {exc}"
        debug = "".join(p.read_text(errors="replace") for p in sorted(Path(debug_dir).glob("nccl.*")))
        out["nccl_debug"] = debug[-4000:]
        text += ("\n--- NCCL_DEBUG=WARN ---\n" + debug) if debug else ""
        out["error"] = text[-6000:]
        out["status"], reason = classify(text)
        if reason:
            out["reason"] = reason
    out["seconds"] = time.perf_counter() - start
    return out


def dry_run() -> dict:
    """The CPU side, in this process (seconds, for the CPU dry run): both jobs in a gloo world of one."""
    import torch.distributed as dist

    from megatron_ppo.parallel.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        out = {"collectives": _collectives(0, 1), "vocab_parallel_logprobs": _vocab_parallel_logprobs(0, 1)}
    finally:
        dist.destroy_process_group()
    assert out["collectives"]["all_reduce"] == [1.0] * 4, out
    assert out["vocab_parallel_logprobs"]["max_abs_diff"] < 1e-5, out
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the outcome as JSON here")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0, help="s for the ranks' start and each job (under the "
                   "stage's 45 s budget, so a hang is recorded here, not cut off by the script)")
    p.add_argument("--dry-run", action="store_true", help="both jobs in a gloo world of one, in this process")
    p.add_argument("--allow-cpu", action="store_true", help="without a GPU, run the same world on gloo (tests)")
    args = p.parse_args(argv)
    import torch

    if not args.dry_run and not args.allow_cpu and not torch.cuda.is_available():
        p.error("torch sees no GPU (use --dry-run on a CPU machine)")
    if args.dry_run:
        out = dry_run()
        print(json.dumps(out, indent=1))
        return 0
    out = run(args.world, args.timeout)
    summary = {k: v for k, v in out.items() if k not in ("collectives", "vocab_parallel_logprobs", "error")}
    print(json.dumps(summary, indent=1))
    if "error" in out:
        print(out["error"])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if out["status"] == "refused":
        print(f"SKIP: {out['reason']}")
        skip_file = os.environ.get("GPU_CHECK_SKIP_FILE")
        if skip_file:
            Path(skip_file).write_text(out["reason"] + "\n")
        return SKIP
    return 0 if out["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
