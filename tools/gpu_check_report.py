#!/usr/bin/env python
"""Results of tools/gpu_check.sh: its summary on the device, and docs/bench/gpu.md written from them here.

    python tools/gpu_check_report.py summarize --work WORK --results RESULTS --elapsed S --budget S --dry-run 0|1
        (called by gpu_check.sh at its end) RESULTS/results.json: every stage's status and time, the environment,
        the test counts, the sanitizer summaries, the NCCL outcome, the PPO step, the decode speeds (stage decode:
        tools/bench_decode.py); RESULTS/summary.md: the same, readable.
    python tools/gpu_check_report.py record DIR [--out docs/bench/gpu.md] [--kernels-page docs/bench/kernels.md]
        (gpu_check.sh --record DIR) DIR holds the files the device call brought back (results.json, ppo_step.json,
        decode.json, kernels_gpu.md, ...): writes the GPU page (with a 'pending' decode section when no run of
        it measured the decode step), and the GPU section of the kernels page from kernels_gpu.md
        (tools/bench_kernels.py --record-gpu; --kernels-page '' leaves it alone). Then regenerate
        docs/benchmarks.md with tools/collect_benchmarks.py.
    python tools/gpu_check_report.py placeholder [--out docs/bench/gpu.md]
        the page before any device run: what the script will measure, and that it has never run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "bench" / "gpu.md"
KERNELS_PAGE = ROOT / "docs" / "bench" / "kernels.md"
DEVICE_CALL = 'run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=600)'
DECODE_CALL = "run(command='GPU_CHECK_ONLY=decode GPU_CHECK_BUDGET_S=200 bash tools/gpu_check.sh', carry=['.whl'], " \
              "timeout_s=300)"
DECODE_GOALS = ">= 20,000 tokens/s at 64 prompts x 256 new tokens, >= 40,000 tokens/s at 256 x 512, a decode step " \
               "<= 3 ms at 64 rows"


UPDATE_CALL = "run(command='GPU_CHECK_ONLY=ppo_step GPU_CHECK_BUDGET_S=420 bash tools/gpu_check.sh', carry=['.whl'], " \
              "timeout_s=540)"
UPDATE_GOALS = "actor update MFU >= 30 % on the 0.5 B shape and >= 40 % on the 1.5 B shape with 16k-token " \
               "micro-batches, at most 8 host reads per micro-batch"


def stage_list() -> list[tuple[str, int, str]]:
    """(name, budget s, what) of every stage, from the script itself (``gpu_check.sh --list``)."""
    out = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--list"], capture_output=True, text=True,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        name, budget, what = line.split("\t")
        rows.append((name, int(budget), what))
    return rows


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_counts(path: Path) -> dict | None:
    """tests / failures / errors / skipped of a pytest junit XML, with the skip reasons."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["skip_reasons"] = sorted({(c.find("skipped").get("message") or "")[:200] for s in suites
                                     for c in s.iter("testcase") if c.find("skipped") is not None})
    counts["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None][:30]
    return counts


def sanitizer_summary(log: Path) -> str | None:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    lines = [ln.strip("= ").strip() for ln in text.splitlines() if re.search(r"(ERROR|RACECHECK) SUMMARY", ln)]
    if "Device not supported" in text:
        lines.append("Device not supported")
    return "; ".join(lines) or "no summary line (see logs.tar.gz)"


def summarize(args) -> int:
    work, results = Path(args.work), Path(args.results)
    what = {name: w for name, _, w in stage_list()}
    stages = []
    for n, line in enumerate((work / "stages.tsv").read_text().splitlines(), 1):
        name, status, seconds, budget = line.split("\t")
        stages.append({"n": n, "name": name, "status": status, "seconds": int(seconds), "budget_s": int(budget),
                       "what": what.get(name, "")})
    counts = {"ok": sum(s["status"] == "ok" for s in stages),
              "skipped": sum(s["status"].startswith("skipped") for s in stages)}
    counts["failed"] = len(stages) - counts["ok"] - counts["skipped"]
    logs = work / "logs"
    out = {
        "dry_run": args.dry_run == "1", "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "elapsed_s": args.elapsed, "budget_s": args.budget, "stages": stages,
        "counts": counts, "env": read_json(work / "env.json"),
        "parity": junit_counts(logs / "parity.xml"), "parity_gae_serial": junit_counts(logs / "parity_gae_serial.xml"),
        "models": junit_counts(logs / "models.xml"),
        "sanitizer": {tool: sanitizer_summary(logs / f"sanitizer_{tool}.log") for tool in ("memcheck", "racecheck")},
        "nccl": read_json(work / "nccl.json"),
        "ppo_step": read_json(results / "ppo_step.json") or read_json(work / "ppo_step_dry.json"),
        "engines": read_json(results / "engines.json"),
        "decode": read_json(results / "decode.json") or read_json(work / "decode_dry.json"),
        "kernels_gpu_md": (results / "kernels_gpu.md").is_file(),
    }
    (results / "results.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    (results / "summary.md").write_text(summary_markdown(out))
    print(results / "summary.md")
    return 0


def stage_table(stages: list[dict]) -> list[str]:
    lines = ["| # | stage | what | result | time (s) / budget |", "|---:|---|---|---|---:|"]
    for s in stages:
        status = s["status"] if s["status"] == "ok" else f"**{s['status']}**" if not s["status"].startswith(
            "skipped") else s["status"]
        lines.append(f"| {s['n']} | {s['name']} | {s['what']} | {status} | {s['seconds']} / {s['budget_s']} |")
    return lines


def fmt_tests(c: dict | None) -> str:
    if not c:
        return "not run"
    text = f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
    if c["failed_tests"]:
        text += " (failed: " + ", ".join(f"`{t}`" for t in c["failed_tests"][:10]) + ")"
    return text


def ppo_lines(p: dict) -> list[str]:
    if "step_s" not in p:  # the dry run's record
        return [f"Dry run only: {p.get('arch')} with {p.get('actor_params', 0):,} parameters, roles "
                f"{p.get('roles')}, launcher={p.get('launcher')}, device={p.get('device')}."]
    t = p.get("timing_s", {})
    micro = (f"micro-batches by a {p['micro_tokens']}-token budget" if p.get("micro_tokens")
             else f"micro-batch {p['micro_batch']}")
    lines = [
        f"{p['arch']} ({p['actor_params']:,} parameters; critic {p['critic_params']:,}), {p['dtype']}, "
        f"{p['transformer_impl']} spec, ops backend {p['ops_backend']}, on {p['device']} (torch {p['torch']}); "
        f"{p['batch']} prompts x {p['response_length']} response tokens per step, {micro}, "
        f"{p['steps']} steps, medians of the last {p['steps_measured']} (first step excluded as warm-up). Model "
        f"build {p['build_s']:.1f} s; peak GPU memory allocated {p.get('max_memory_allocated_gib') or 0:.1f} GiB.",
        "",
        "| step (s) | gen | old_log_prob (actor + ref + values) | update_critic | update_actor | tokens/step | "
        "tokens/s | MFU 6·N·tokens/step | MFU actor update | MFU all passes |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {p['step_s']:.2f} | {t.get('gen', 0):.2f} | {t.get('old_log_prob', 0):.2f} | "
        f"{t.get('update_critic', 0):.2f} | {t.get('update_actor', 0):.2f} | {p['tokens_per_step']:.0f} | "
        f"{p['tokens_per_s']:.0f} | {p['mfu_6nt_step']:.2%} | {p['mfu_actor_update']:.2%} | "
        f"{p['mfu_all_passes_step']:.2%} |",
        "",
        f"MFU against a peak of {p['peak_flops'] / 1e12:.0f} TFLOP/s (H200 SXM dense bf16, datasheet; measured "
        "769-798 TFLOP/s on 8192^3 products there, KINDS.md). '6·N·tokens/step' is the brief's formula: 6 x the "
        "actor's parameters (tied embedding once) x every prompt + response token of the step, over the whole step "
        "(generation included); 'actor update' the same over the actor's update phase; 'all passes' counts every "
        "forward (2 N per token) and backward (4 N) of every role in the step. Attention score FLOPs are left out.",
    ]
    calls = p.get("worker_calls")
    if calls:
        roles = calls.get("by_role", {})
        peaks, transient = calls.get("peak_gib_by_role", {}), calls.get("transient_gib_by_role", {})
        lines += ["", "| role | micro-batches | host reads | peak GiB in its calls | transient GiB |",
                  "|---|---:|---:|---:|---:|"]
        for role, c in roles.items():
            lines.append(f"| {role} | {c['micro_batches']} | {c['reads']} | {peaks.get(role, 0):.1f} | "
                         f"{transient.get(role, 0):.1f} |")
        lines += ["", f"Host reads in the workers' device-side calls (testing/host_reads.py, the measured steps): "
                      f"{calls['reads_per_micro_batch'] or 0:.1f} per micro-batch (issue 47's budget: 8). Peaks "
                      "are the process's (every role's resident state is in it: launcher=local); transient is a "
                      "call's peak minus what was allocated when it began."]
    thd = p.get("thd_attention")
    if thd:
        lines += ["", "Packed attention strategies (tools/bench_thd_attention.py, actor forward + backward of one "
                      "micro-batch, interleaved rounds):", "", "| shape | tokens | strategy | ms | tokens/s |",
                  "|---|---:|---|---:|---:|"]
        for r in thd:
            lines += [f"| {r['shape']} | {r['tokens']} | {name} | {row['ms']:.1f} | {row['tokens_per_s']:.0f} |"
                      for name, row in r["strategies"].items() if row]
    if p.get("qwen2-1.5b"):
        lines += ["", "### The 1.5 B shape", ""] + ppo_lines(p["qwen2-1.5b"])
    return lines


def summary_markdown(r: dict) -> str:
    env = r.get("env") or {}
    c = r["counts"]
    lines = [f"# gpu_check {'(dry run) ' if r['dry_run'] else ''}{r['finished_utc']}", "",
             f"`gpu_check: {c['ok']} ok, {c['failed']} failed, {c['skipped']} skipped in {r['elapsed_s']} s` "
             f"(budget {r['budget_s']} s)", ""]
    if env:
        lines += [f"Machine: {env.get('gpu', 'no GPU')} (capability {env.get('capability', '-')}, {env.get('sms', '-')} "
                  f"SMs, {env.get('gpu_memory_gib', '-')} GiB), Python {env.get('python')}, torch {env.get('torch')} "
                  f"(CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn', '-')}, NCCL {env.get('nccl', '-')}), "
                  f"megatron-core in the image: {env.get('megatron_core')} (stage deps installs the carried wheel), "
                  f"Transformer Engine: {env.get('transformer_engine')}, "
                  f"triton {env.get('triton')}, transformers {env.get('transformers')}.", ""]
    lines += stage_table(r["stages"]) + [""]
    lines += [f"- parity (CUDA_LAUNCH_BLOCKING=1): {fmt_tests(r.get('parity'))}; GAE with the serial algorithm: "
              f"{fmt_tests(r.get('parity_gae_serial'))}",
              f"- models (test_models_gpu.py): {fmt_tests(r.get('models'))}"
              + (f"; skipped because: {'; '.join(r['models']['skip_reasons'])}" if r.get("models") and
                 r["models"]["skip_reasons"] else ""),
              f"- compute-sanitizer: memcheck: {r['sanitizer'].get('memcheck') or 'not run'}; racecheck: "
              f"{r['sanitizer'].get('racecheck') or 'not run'}"]
    nccl = r.get("nccl")
    if nccl:
        detail = nccl.get("reason") or (nccl.get("error") or "")[-400:] if nccl["status"] != "ok" else (
            "all-reduce, all-gather, broadcast and the vocab-parallel log-prob op over 2 ranks agree")
        lines.append(f"- NCCL world of 2 on one GPU (NCCL {nccl.get('nccl_version', '?')}): {nccl['status']}: "
                     f"{detail}")
    else:
        lines.append("- NCCL world of 2 on one GPU: not run")
    lines.append("")
    if r.get("ppo_step"):
        lines += ["## PPO step", ""] + ppo_lines(r["ppo_step"]) + [""]
    if r.get("decode"):
        lines += ["## Decode step (stage decode, issue 46)", ""] + decode_lines(r["decode"]) + [""]
    if r.get("engines"):
        lines += ["## Rollout engines (stage vllm)", ""] + engine_lines(r["engines"]) + [""]
    return "\n".join(lines) + "\n"


def decode_lines(d: dict) -> list[str]:
    """tools/bench_decode.py's results: what ran, the systems x cases table, the goals."""
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_decode import markdown  # noqa: E402 (a tool beside this one)

    lo, hi = d["prompt_len"]
    head = (f"{d['arch']} ({d['params']:,} parameters, {d['dtype']}, {d['transformer_impl']} spec, random weights) on "
            f"{d['device']} (torch {d['torch']}): prompts of {lo}-{hi} random token ids, temperature 1, no eos (every "
            f"row makes exactly its N tokens), `DecodeOptions` defaults but for each system's own: eager = "
            f"`static_step=False` (megatron's forward every step), static = `cuda_graphs=\"false\"`, graphs = "
            f"`cuda_graphs=\"true\"`. ms / decode step = (wall - a 1-token run's wall) / (N - 1); host reads = "
            f"outermost `item` / `_local_scalar_dense` / `nonzero` / `equal` / `is_nonzero` ops after the prefill "
            f"(torch.profiler, a run of up to {d['profile_steps']} decode steps) per step. Floor: "
            f"{d['param_bytes'] / 1e9:.3g} GB of {d['dtype']} weights / {d['bandwidth_gbs']:g} GB/s = "
            f"{d['floor_ms']:.3g} ms per step (KV cache reads "
            "left out).")
    if d.get("dry_run"):
        head = "Dry run only (CPU, not a measurement): " + head
    lines = [head, "", markdown(d).rstrip()]
    kv = [f"{c['case']} {c['floor_with_kv_ms']:.3g} ms" for c in d["cases"] if c.get("floor_with_kv_ms")]
    if kv:
        lines.append(f"- floor with the static KV cache's full read per step: {', '.join(kv)}")
    lines.append(f"- `{d['command']}`, {d.get('elapsed_s', 0):.0f} s in all (model build {d['build_s']:.1f} s)")
    return lines


def decode_pending_lines(stages: list[tuple[str, int, str]] | None = None) -> list[str]:
    """The page's decode section while no device run has measured it."""
    budget, what = next(((b, w) for n, b, w in (stages or stage_list()) if n == "decode"), (90, ""))
    return ["## Decode step (issue 46)", "",
            "**Pending (no GPU lent).** The Megatron engine's generation speed at the Qwen2.5-0.5B shape in bf16 "
            "(random weights), three systems interleaved in one process: today's eager step "
            "(`DecodeOptions(static_step=False)`: megatron's forward every step), the static loop (`cuda_graphs=\"false\"`) and the static loop as CUDA "
            "graphs (`cuda_graphs=\"true\"`); per system and case (64x256, 256x512): tokens/s, ms per decode step "
            "and its ratio to the bandwidth floor (bf16 weights / the GPU's memory bandwidth), host reads per step. "
            f"Goals: {DECODE_GOALS}.", "",
            "| stage | what | budget (s) | result |", "|---|---|---:|---|",
            f"| decode | {what} | {budget} | pending (no GPU lent) |", "",
            "Run `bash tools/gpu_check_prepare.sh` here, then the device call "
            f"`{DECODE_CALL}` (env, deps and decode only: about 2 minutes on the machine), then "
            "`bash tools/gpu_check.sh --record <the folder the files came back to>` (it keeps this section pending "
            "until a run brings `decode.json` back). On a CPU, `python tools/bench_decode.py --dry-run` runs the "
            "eager and static systems on a tiny fp32 model in seconds."]


def update_measured(ppo_step: dict | None) -> bool:
    """A ppo_step result from issue 47's stage (token-budget micro-batches, host reads counted)."""
    return bool(ppo_step and ppo_step.get("worker_calls"))


def update_pending_lines() -> list[str]:
    """The page's section on the Megatron update (issue 47) while no device run has measured it."""
    return ["## The Megatron update on a GPU (issue 47)", "",
            "**Pending (no GPU lent).** Stage ppo_step as issue 47 left it: 128 prompts x 256 tokens, every role's "
            "micro-batches by a 16k-token budget, the packed attention without host reads (varlen where the torch "
            "build has it, else padded SDPA), megatron's fusions where their libraries are, DDP's overlaps on NCCL; "
            "then the 1.5 B shape if the stage has 100 s left. It reports the actor update's MFU, host reads per "
            f"micro-batch and each role's peak memory. Goals: {UPDATE_GOALS}.", "",
            "Run `bash tools/gpu_check_prepare.sh` here, then the device call "
            f"`{UPDATE_CALL}` (env, deps, build and ppo_step), then `bash tools/gpu_check.sh --record <the folder "
            "the files came back to>` (it keeps this section pending until a ppo_step result with host-read counts "
            "comes back). On a CPU, `python -m megatron_ppo.testing.gpu_step --arch tiny --device cpu --steps 2 "
            "--batch 8 --response-length 8 --micro-tokens 256` runs the same path on a tiny fp32 model."]


def engine_lines(e: dict) -> list[str]:
    rows = ["| engine | generation tokens/s | gen s/step | sync_weights s/step | step s |", "|---|---:|---:|---:|---:|"]
    for name in ("megatron", "vllm"):
        p = e[name]
        t = p["timing_s"]
        rows.append(f"| {name} | {p['gen_tokens_per_s']:.0f} | {t.get('gen', 0):.2f} | {t.get('sync_weights', 0):.3f} "
                    f"| {p['step_s']:.2f} |")
    p = e["megatron"]
    return rows + ["", f"{p['arch']} ({p['dtype']}), {p['batch']} prompts x {p['response_length']} response tokens, "
                   f"median of the steps after the first: vLLM / Megatron engine = "
                   f"**{e['vllm_over_megatron_gen']:.2f}x** (issue 25's goal: >= 3x)."]


# ---------------------------------------------------------------------------------------------- docs page

def page_header() -> list[str]:
    return ["## GPU check (tools/gpu_check.sh, issue 23)", "",
            "One script proves the GPU path on the device machine (one H200, no network) in at most 8 minutes of "
            "its own wall time, each stage under its own budget. Run `tools/gpu_check_prepare.sh` here first (it "
            "puts the megatron-core wheel for the device's Python 3.12 into `.whl/`), then the device call "
            f"`{DEVICE_CALL}`, then `bash tools/gpu_check.sh --record <the folder the files came back to>`, which "
            "writes this page. `bash tools/gpu_check.sh --dry-run` runs the CPU side of every stage (CI does, "
            "through tests/unit/test_gpu_check_script.py).", ""]


def placeholder(args) -> int:
    lines = page_header() + ["**Never run: no GPU has been lent to this project yet.** What the script will "
                             "measure, stage by stage (each budget, in seconds, is a ceiling: a stage gets at most what is left "
                             "of the run's 480 s; about 330 s are expected in all):", "",
                             "| # | stage | what | budget (s) |", "|---:|---|---|---:|"]
    lines += [f"| {n} | {name} | {what} | {budget} |" for n, (name, budget, what) in enumerate(stage_list(), 1)]
    lines += ["", "Results come back as up to eight files: `gpu_check.log` (the console), `summary.md`, "
              "`results.json`, `logs.tar.gz` (a log per stage, junit XML, sanitizer and build logs), `ppo_step.json`, "
              "`kernels_gpu.md`, `decode.json` (stage decode: tools/bench_decode.py) and `engines.json` (stage vllm, "
              "run alone: `GPU_CHECK_ONLY=vllm "
              "GPU_CHECK_BUDGET_S=420 bash tools/gpu_check.sh`: the same PPO step with rollout.name=megatron and "
              "=vllm at 256 prompts x 512 tokens, generation tokens/s of each; it needs vLLM in the image). The PPO "
              "step reports its step time, tokens/s and MFU = 6 x parameters x tokens / "
              "step time / 989 TFLOP/s (the H200's dense bf16 datasheet peak), beside the actor update's own MFU "
              "and an all-passes FLOP count; the NCCL stage records NCCL's answer to two ranks on one GPU (it "
              "normally refuses them: 'Duplicate GPU detected')."]
    lines += [""] + decode_pending_lines() + [""] + update_pending_lines()
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


def record(args) -> int:
    src = Path(args.dir)
    r = read_json(src / "results.json")
    if r is None:
        sys.exit(f"gpu_check_report record: {src}/results.json missing or unreadable (the device run's files?)")
    if r.get("dry_run"):
        sys.exit("gpu_check_report record: these are a dry run's results; record a device run's")
    if not r.get("ppo_step") and (src / "ppo_step.json").is_file():
        r["ppo_step"] = read_json(src / "ppo_step.json")
    if not r.get("decode") and (src / "decode.json").is_file():
        r["decode"] = read_json(src / "decode.json")
    decode_measured = bool(r.get("decode"))
    ppo_measured = update_measured(r.get("ppo_step"))
    c = r["counts"]
    lines = page_header() + [f"Run finished {r['finished_utc']}: `gpu_check: {c['ok']} ok, {c['failed']} failed, "
                             f"{c['skipped']} skipped in {r['elapsed_s']} s`.", ""]
    body = summary_markdown(r).split("\n", 3)[3]  # the summary without its title and count line
    lines += [body.strip(), ""]
    kernels = src / "kernels_gpu.md"
    if kernels.is_file():
        lines += ["## Kernels on the GPU (tools/bench_kernels.py --device cuda)", "",
                  kernels.read_text().strip(), ""]
        if args.kernels_page:
            sys.path.insert(0, str(ROOT / "tools"))
            from bench_kernels import record_gpu_section  # noqa: E402 (a tool beside this one)

            record_gpu_section(Path(args.kernels_page), kernels.read_text())
            print(f"updated the GPU section of {args.kernels_page}")
    logs = src / "logs.tar.gz"
    if logs.is_file():
        with tarfile.open(logs) as tar:
            names = [m.name for m in tar.getmembers() if m.isfile()]
        lines += [f"Logs of that run: logs.tar.gz ({len(names)} files), not committed.", ""]
    if args.notes:
        lines += [Path(args.notes).read_text().strip(), ""]
    for rerun in args.rerun or ():  # a later call of the same lease or session, after fixes (GPU_CHECK_ONLY=...)
        rr = read_json(Path(rerun) / "results.json")
        if rr is None or rr.get("dry_run"):
            sys.exit(f"gpu_check_report record: {rerun}/results.json missing, unreadable or a dry run's")
        if not rr.get("ppo_step") and (Path(rerun) / "ppo_step.json").is_file():
            rr["ppo_step"] = read_json(Path(rerun) / "ppo_step.json")
        if not rr.get("decode") and (Path(rerun) / "decode.json").is_file():
            rr["decode"] = read_json(Path(rerun) / "decode.json")
        decode_measured = decode_measured or bool(rr.get("decode"))
        ppo_measured = ppo_measured or update_measured(rr.get("ppo_step"))
        rc = rr["counts"]
        lines += [f"## Rerun, finished {rr['finished_utc']}", "",
                  f"`gpu_check: {rc['ok']} ok, {rc['failed']} failed, {rc['skipped']} skipped in {rr['elapsed_s']} s`",
                  "", summary_markdown(rr).split("\n", 3)[3].strip(), ""]
    if not decode_measured:
        lines += decode_pending_lines() + [""]
    if not ppo_measured:
        lines += update_pending_lines() + [""]
    Path(args.out).write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.out}; now: python tools/collect_benchmarks.py")
    return 0


def engines(args) -> int:
    """Stage vllm: both engines' gpu_step results in one file, and the generation speed ratio (issue 25's goal:
    vLLM >= 3x the Megatron engine at 256 x 512)."""
    ours, vllm = (json.loads(Path(p).read_text()) for p in (args.megatron, args.vllm))
    ratio = vllm["gen_tokens_per_s"] / ours["gen_tokens_per_s"]
    Path(args.out).write_text(json.dumps({"megatron": ours, "vllm": vllm, "vllm_over_megatron_gen": ratio},
                                         indent=1, default=str) + "\n")
    print(f"generation at {ours['batch']} x {ours['response_length']}: megatron {ours['gen_tokens_per_s']:.0f} "
          f"tokens/s, vllm {vllm['gen_tokens_per_s']:.0f} tokens/s: {ratio:.2f}x (goal >= 3x); vllm weight sync "
          f"{vllm['timing_s'].get('sync_weights', float('nan')):.2f} s per step")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("--work", required=True)
    s.add_argument("--results", required=True)
    s.add_argument("--elapsed", type=int, required=True)
    s.add_argument("--budget", type=int, required=True)
    s.add_argument("--dry-run", default="0")
    r = sub.add_parser("record")
    r.add_argument("dir")
    r.add_argument("--out", default=str(PAGE))
    r.add_argument("--kernels-page", default=str(KERNELS_PAGE), help="'' leaves the kernels page alone")
    r.add_argument("--rerun", action="append", help="a later run's folder (after fixes): appended as a section")
    r.add_argument("--notes", help="a markdown file of findings, put between the first run and the reruns")
    ph = sub.add_parser("placeholder")
    ph.add_argument("--out", default=str(PAGE))
    e = sub.add_parser("engines")
    e.add_argument("megatron")
    e.add_argument("vllm")
    e.add_argument("--out", required=True)
    args = p.parse_args(argv)
    return {"summarize": summarize, "record": record, "placeholder": placeholder, "engines": engines}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
