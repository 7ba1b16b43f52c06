#!/usr/bin/env python
"""Benchmark HF <-> Megatron conversion: time and peak memory, streaming vs all-at-once, side by side.

Models: SmolLM2-135M-Instruct (the cached HF folder the tests build under build/) and a synthetic random
Llama-3.2-1B-shaped model (1.24B parameters, bf16) written to a scratch directory and deleted afterwards.
Every measurement runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is the conversion's alone; the
converter's own sampler adds the RSS before converting (imports) and the anonymous (not file-backed) peak.

``--section import``: a role started from SmolLM2's HF files at TP=1, TP=3 and PP=2, gloo ranks in fresh
processes, each rank's RSS sampled while it imports: the import as it was (the driver's TP=1 conversion, then
``dist_checkpointing.load`` of it on every rank) against each rank reading its own slices (``load_hf_weights``).
Each section rewrites its own part of the output file.

  python tools/bench_convert.py [--section convert|import|all] [--models smollm2,synthetic-1b] [--scratch /tmp]
                                [--out docs/bench/convert.md]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.path.join(REPO, "build", "smollm2-135m-instruct-hf")
SYNTHETIC_1B = dict(  # Llama-3.2-1B's shape
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
    rope_theta=500000.0, dtype="bfloat16",
)


def write_random_llama(config: dict, out_dir: str, shard_bytes: int = 1 << 30) -> None:
    """A random HF Llama checkpoint, generated tensor by tensor (memory: one shard)."""
    import torch

    from megatron_ppo.convert.hf_io import ShardedSafetensorsWriter
    from megatron_ppo.convert.mapping import arch_from_hf_config, hf_tensor_shapes

    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shapes = hf_tensor_shapes(arch_from_hf_config(config))
    plan = [(n, s, torch.bfloat16) for n, s in shapes.items()]
    writer = ShardedSafetensorsWriter(out_dir, plan, shard_bytes)
    g = torch.Generator().manual_seed(0)
    for name, shape, dtype in plan:
        t = torch.ones(shape) if "norm" in name else torch.randn(shape, generator=g) * 0.02
        writer.add(name, t.to(dtype))
    writer.finish()


# ------------------------------------------------------------------------------------------------------------------
# Child side: one conversion per process
# ------------------------------------------------------------------------------------------------------------------
def naive_hf_to_mcore(hf_dir: str, out_dir: str) -> dict:
    """The all-at-once baseline: every tensor read and converted, then one dist_checkpointing.save of the whole
    sharded state dict (what a converter that builds the full state dict does)."""
    import psutil
    import torch  # noqa: F401

    from megatron.core import dist_checkpointing

    from megatron_ppo.convert.hf_io import HFCheckpoint
    from megatron_ppo.convert.mapping import arch_from_hf_config, conversion_pieces, to_mcore
    from megatron_ppo.convert.mcore_io import save_strategy, sharded_objects, sharded_tensors, single_process_group

    arch = arch_from_hf_config(hf_dir)
    ck = HFCheckpoint(hf_dir)
    with single_process_group():
        baseline = psutil.Process().memory_info().rss
        t0 = time.perf_counter()
        state = {}
        for piece in conversion_pieces(arch, 1):
            hf = ck.read(piece.hf_names)
            for m in piece.maps:
                state.update(sharded_tensors(m, to_mcore(m, hf, arch), arch.num_layers, ""))
            if piece.layer is not None:
                state.update(sharded_objects("", piece.layer, arch.num_layers))
        os.makedirs(out_dir)
        dist_checkpointing.save(state, out_dir, sharded_strategy=save_strategy())
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "baseline": baseline}


def child(args) -> None:
    if args.mode == "write-random":
        write_random_llama(SYNTHETIC_1B, args.dst)
        print("BENCH_RESULT {}")
        return
    if args.mode == "facts":
        print("BENCH_RESULT " + json.dumps(model_facts(args.src)))
        return
    _convert_child(args)


def _convert_child(args) -> None:
    # Import the heavy libraries first: the measured time and the "before" RSS are the conversion's alone.
    import megatron.core.dist_checkpointing  # noqa: F401
    import transformers.models.llama.configuration_llama  # noqa: F401
    from transformers import AutoConfig  # noqa: F401

    from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf

    if args.mode == "hf-to-mcore":
        r = hf_to_mcore(args.src, args.dst, tp=args.tp, quiet=True)
    elif args.mode == "mcore-to-hf":
        r = mcore_to_hf(args.src, args.dst, max_shard_size=args.shard, quiet=True)
    if args.mode in ("hf-to-mcore", "mcore-to-hf"):
        out = {"seconds": r.seconds, "baseline": r.baseline_rss_bytes, "sampled_peak": r.peak_rss_bytes,
               "anon_growth": r.peak_anon_rss_bytes - r.baseline_anon_rss_bytes,
               "largest_piece": r.largest_piece_bytes}
    else:
        out = naive_hf_to_mcore(args.src, args.dst)
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # megatron's writer forks a process per piece; it shares the converter's pages, and touches the piece's.
    out["ru_maxrss_children"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print("BENCH_RESULT " + json.dumps(out))


def run_child(mode: str, src: str, dst: str, tp: int = 1, shard: str = "2GB") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--src", src, "--dst", dst, "--tp", str(tp),
           "--shard", shard]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")][-1]
    return json.loads(line[len("BENCH_RESULT "):])


# ------------------------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------------------------
def model_facts(hf_dir: str) -> dict:
    from megatron_ppo.convert.hf_io import HFCheckpoint
    from megatron_ppo.convert.mapping import arch_from_hf_config, conversion_pieces

    arch = arch_from_hf_config(hf_dir)
    ck = HFCheckpoint(hf_dir)
    itemsize = next(iter(ck.entries.values())).dtype.itemsize
    pieces = conversion_pieces(arch, 1)
    layer = sum(m.numel for m in pieces[1].maps) * itemsize
    embed = sum(m.numel for m in pieces[0].maps) * itemsize
    entries = list(ck.entries.values())
    return {"params": sum(e.numel for e in entries), "bytes": sum(e.numel * itemsize for e in entries),
            "layer_bytes": layer, "embedding_bytes": embed, "dtype": str(entries[0].dtype)}


# ------------------------------------------------------------------------------------------------------------------
# A role's import of the HF weights, per rank
# ------------------------------------------------------------------------------------------------------------------
IMPORT_HEADING = "## Starting a role from HF weights: memory per rank"
IMPORT_LAYOUTS = ((1, 1), (3, 1), (1, 2))  # SmolLM2-135M has 9 heads, 3 KV groups: TP=2 is impossible, TP=3 is not
IMPORT_MODES = {"dcp": "TP=1 conversion + dist_checkpointing.load (before)", "slices": "own slices (now)"}


def _import_job(rank, world, tp, pp, mode, hf_dir, ckpt):
    """(A job of a fresh pool.) Build the actor stage, then import its weights while a thread samples RSS."""
    import gc

    import psutil

    from megatron_ppo import parallel
    from megatron_ppo.convert.hf_import import load_hf_weights
    from megatron_ppo.convert.mapping import arch_from_hf_config
    from megatron_ppo.convert.report import RssSampler
    from megatron_ppo.convert.verify import load_dist_checkpoint
    from megatron_ppo.models.gpt import build_gpt_model

    parallel.initialize(tp=tp, pp=pp)
    try:
        model = build_gpt_model(arch_from_hf_config(hf_dir), "actor")
        if mode == "dcp":  # megatron's loader imported and warmed up, as the slices path's all_gather is
            from megatron.core import dist_checkpointing  # noqa: F401
        gc.collect()
        proc = psutil.Process()
        with RssSampler(interval=0.002) as rss:
            t0, rchar = time.perf_counter(), proc.io_counters().read_chars
            if mode == "slices":  # the bytes copied out of the memory-mapped files (no read() calls)
                read = load_hf_weights(model, "actor", hf_dir).bytes_read
            else:  # what load_hf_weights did before: the whole TP=1 chunks read, then narrowed to this rank's shard
                load_dist_checkpoint(model, ckpt, strict=True)
                read = proc.io_counters().read_chars - rchar  # DCP reads its files with read()
            seconds = time.perf_counter() - t0
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"rank": rank, "seconds": seconds, "baseline": rss.baseline, "peak": rss.peak,
                "anon_growth": rss.peak_anon - rss.baseline_anon, "shard": shard, "read": read}
    finally:
        parallel.destroy(destroy_process_group=False)


def bench_import(scratch: str) -> list:
    ckpt = os.path.join(scratch, "smollm2-mcore-tp1")
    run_child("hf-to-mcore", SMOLLM2, ckpt, 1)  # the driver's conversion of the import as it was
    # imported after every conversion child ran: ru_maxrss survives execve, and this process must stay small
    sys.path.insert(0, REPO)
    from megatron_ppo.parallel.launch import LocalWorkerPool
    rows = []
    for tp, pp in IMPORT_LAYOUTS:
        for mode in IMPORT_MODES:
            with LocalWorkerPool(tp * pp) as pool:  # fresh processes: nothing left from another run
                ranks = pool.run(_import_job, tp, pp, mode, SMOLLM2, ckpt)
            rows.append((tp, pp, mode, ranks))
            worst = max(r["peak"] - r["baseline"] for r in ranks)
            print(f"import TP={tp} PP={pp} {mode:6s}: worst rank +{mib(worst)} MiB over its built model", flush=True)
    return rows


def render_import(rows: list, command: str) -> str:
    out = [IMPORT_HEADING, "", f"Command: `{command}` (SmolLM2-135M-Instruct, fp32 safetensors, 513 MiB; "
           "megatron ranks on gloo, one fresh process per rank and run, one thread each, on the 2 shared cores: "
           "times are indicative).", "",
           "*Built* is the rank's RSS once its model stage is built (the imports, the parameters), so",
           "*peak - built* is what importing the weights held: sampled every 2 ms while `load_hf_weights`",
           "(own slices) or `dist_checkpointing.load` of the driver's TP=1 conversion (the import as it was)",
           "ran. *Anon* leaves out file-backed pages (memory-mapped safetensors; the page cache the ranks of a",
           "node share). *Shard* is the rank's parameters. *Read*: before, the bytes the rank's",
           "`dist_checkpointing.load` read (`read()` calls, /proc/self/io); now, the bytes of the slices the rank",
           "copied out of the memory-mapped HF files (their pages are faulted in, not `read()`).",
           "The per-rank numbers are the worst rank's; time is the slowest rank's.", "",
           "| layout | ranks | import | peak RSS MiB | built MiB | peak - built MiB | anon growth MiB | shard MiB "
           "| read MiB | time s |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for tp, pp, mode, ranks in rows:
        worst = max(ranks, key=lambda r: r["peak"] - r["baseline"])
        read = max(r["read"] for r in ranks)
        out.append(f"| TP={tp} PP={pp} | {tp * pp} | {IMPORT_MODES[mode]} | {mib(worst['peak'])} | "
                   f"{mib(worst['baseline'])} | {mib(worst['peak'] - worst['baseline'])} "
                   f"| {mib(max(r['anon_growth'] for r in ranks))} | {mib(max(r['shard'] for r in ranks))} | "
                   f"{mib(read)} | {max(r['seconds'] for r in ranks):.2f} |")
    out += ["", "Reading the numbers:", "",
            "- Before, every rank read the whole TP=1 tensors of its stage (at TP=3, 519 MiB to hold 171 MiB) and",
            "  held up to twice the largest of them (the 108 MiB embedding) in anonymous memory on top of its model.",
            "- Now a rank reads its shard and nothing else; what the import holds beyond the model is the block of",
            "  rows being copied (`hf_slices.READ_BLOCK_BYTES`, 32 MiB of mapped file pages), at any layout and for",
            "  any model size. The rank's anonymous memory does not grow: slices are copied into the parameters",
            "  in place.",
            "- A column-parallel cut (row-parallel layers, TP > 1) reads every row's part: when a row's part is",
            "  smaller than a page the whole tensor's pages are faulted in, one block at a time (SmolLM2's rows",
            "  are 2.3 KiB). Nothing of it is copied beyond the shard.",
            "- Not counted here: the driver no longer converts (the streaming TP=1 conversion above, ~7 s and a",
            "  cache directory per model).", ""]
    return "\n".join(out)


def splice(path: str, text: str, heading: str | None) -> str:
    """The file at ``path`` with its section under ``heading`` (to the end) replaced by ``text``; heading None:
    ``text`` replaces everything before that section."""
    old = open(path).read() if os.path.isfile(path) else ""
    head, sep, tail = old.partition(IMPORT_HEADING)
    tail = sep + tail
    if heading is None:
        return text.rstrip("\n") + "\n" + ("\n" + tail if tail else "")
    return (head.rstrip("\n") + "\n\n" if head else "") + text


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def bench_model(name: str, hf_dir: str, scratch: str, rows: list, naive: bool = True) -> dict:
    facts = run_child("facts", hf_dir, "")
    mcore = os.path.join(scratch, f"{name}-mcore")
    runs = [("hf-to-mcore (streaming, TP=1)", "hf-to-mcore", hf_dir, mcore, 1, "2GB")]
    if naive:
        runs.append(("hf-to-mcore (all at once: one dist_checkpointing.save)", "naive", hf_dir, mcore + "-naive",
                     1, ""))
    runs += [("mcore-to-hf (2GB shards)", "mcore-to-hf", mcore, os.path.join(scratch, f"{name}-hf2"), 1, "2GB"),
             ("mcore-to-hf (200MB shards)", "mcore-to-hf", mcore, os.path.join(scratch, f"{name}-hf3"), 1, "200MB")]
    for label, mode, src, dst, tp, shard in runs:
        r = run_child(mode, src, dst, tp, shard)
        rows.append((name, facts, label, r))
        print(f"{name:14s} {label:58s} {r['seconds']:7.1f} s  peak RSS {mib(peak(r))} MiB "
              f"(before converting {mib(r['baseline'])} MiB)", flush=True)
    return facts


def peak(r: dict) -> int:
    """Peak RSS of the converter or of any writer process it forked (they share the converter's pages).

    ru_maxrss survives execve on Linux: the driver process stays small (it imports no torch) so that a child's
    ru_maxrss is its own."""
    return max(r["ru_maxrss"], r["ru_maxrss_children"], r.get("sampled_peak", 0))


def render(rows: list, command: str, load: tuple[float, float]) -> str:
    out = ["# Conversion benchmark (HF <-> Megatron dist checkpoint)", "",
           f"Command: `{command}`", "",
           f"Machine: 2 CPU cores, 24 GiB RAM, local disk, shared with other jobs (1-minute load average "
           f"{load[0]:.1f} at the start, {load[1]:.1f} at the end: times are indicative, memory is not affected).",
           "Every run is a fresh process. *Peak RSS* is the largest",
           "`ru_maxrss` of the converter process and of the writer processes megatron's dist_checkpointing forks",
           "(they share the converter's pages and touch the piece they write). *Before* is the converter's RSS after",
           "the imports (torch, megatron-core, transformers), when conversion starts, so *peak - before* is what the",
           "conversion itself held, file-backed pages of memory-mapped safetensors included; *anon growth* is the",
           "converter's growth in anonymous (not file-backed) memory. *Time* excludes the imports (~10-15 s here).",
           "*Largest piece* is the biggest unit the streaming converter holds at once (HF -> Megatron: the",
           "embedding or one layer; Megatron -> HF: a layer plus the safetensors shard being filled).", "",
           "| model | params (dtype) | on disk MiB | run | time s | peak RSS MiB | before MiB | peak - before MiB "
           "| anon growth MiB | largest piece MiB |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, facts, label, r in rows:
        out.append(f"| {name} | {facts['params'] / 1e6:,.0f}M ({facts['dtype'].replace('torch.', '')}) | "
                   f"{mib(facts['bytes'])} | {label} | {r['seconds']:.1f} | {mib(peak(r))} | "
                   f"{mib(r['baseline'])} | {mib(peak(r) - r['baseline'])} | "
                   f"{mib(r['anon_growth']) if 'anon_growth' in r else '-'} | "
                   f"{mib(r['largest_piece']) if 'largest_piece' in r else '-'} |")
    out.append("")
    seen = {}
    for name, facts, _, _ in rows:
        seen[name] = facts
    for name, facts in seen.items():
        out.append(f"- {name}: one decoder layer = {mib(facts['layer_bytes'])} MiB, embedding = "
                   f"{mib(facts['embedding_bytes'])} MiB, whole model = {mib(facts['bytes'])} MiB.")
    out += ["", "Reading the numbers:", "",
            "- HF -> Megatron, streaming: the converter's own (anonymous) memory grows by about a layer; the peak is",
            "  megatron's forked writer mapping the piece it writes, so *peak - before* is about the largest piece",
            "  (for a 128K vocabulary, the embedding), whatever the model size. All at once: the whole model and more.",
            "- Megatron -> HF: about twice max(largest piece, shard). dist_checkpointing's reader holds a chunk's bytes",
            "  while it builds the tensor, and safetensors serialises a shard into one buffer before writing it.",
            "  `--max-shard-size` sets the shard; the model size does not enter (compare the two shard sizes).",
            "- Streaming costs time: one `dist_checkpointing.save` (with its forked writer) per piece.", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--section", default="all", choices=("convert", "import", "all"))
    p.add_argument("--models", default="smollm2,synthetic-1b")
    p.add_argument("--scratch", default=None, help="scratch directory (default: a temp dir under /tmp)")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "bench", "convert.md"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--dst", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--shard", default="2GB", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.mode = args.child
        child(args)
        return 0
    scratch = tempfile.mkdtemp(prefix="bench_convert-", dir=args.scratch)
    load_start = os.getloadavg()[0]
    rows, import_rows = [], []
    if args.section != "convert" and not os.path.isfile(os.path.join(SMOLLM2, "config.json")):
        raise SystemExit(f"{SMOLLM2} missing: run tests/integration/test_convert_smollm2.py once to build it")
    try:
        for name in args.models.split(",") if args.section != "import" else []:
            if name == "smollm2":
                if not os.path.isfile(os.path.join(SMOLLM2, "config.json")):
                    raise SystemExit(f"{SMOLLM2} missing: run tests/integration/test_convert_smollm2.py once "
                                     "to build it")
                bench_model("SmolLM2-135M", SMOLLM2, scratch, rows)
            elif name == "synthetic-1b":
                src = os.path.join(scratch, "synthetic-1b-hf")
                t0 = time.perf_counter()
                run_child("write-random", "", src)
                print(f"synthetic 1B checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
                bench_model("synthetic-1B", src, scratch, rows)
            else:
                raise SystemExit(f"unknown model {name!r} (smollm2, synthetic-1b)")
        if args.section != "convert":  # last: it imports torch into this process (see bench_import)
            import_rows = bench_import(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    command = ("python tools/bench_convert.py " + " ".join(a for a in (argv or sys.argv[1:]))).strip()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    if rows:
        text = splice(args.out, render(rows, command, (load_start, os.getloadavg()[0])), None)
        with open(args.out, "w") as f:
            f.write(text)
    if import_rows:
        text = splice(args.out, render_import(import_rows, command), IMPORT_HEADING)
        with open(args.out, "w") as f:
            f.write(text)
    print(open(args.out).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
