"""Decode speed of the Megatron engine on a GPU (issue 46): today's eager step vs the static loop vs the static loop
as CUDA graphs, at the Qwen2.5-0.5B shape in bf16, the three interleaved in one process.

    python tools/bench_decode.py [--cases 64x256 256x512] [--out decode.json] [--reps 1] [--eager-max-steps 64]
                                 [--bandwidth-gbs GB/s] [--prompt-len 64 128] [--deadline-s S]
    python tools/bench_decode.py --dry-run [--out decode_dry.json]   # CPU: tiny fp32 model, 4x8 8x16, seconds
    GPU_CHECK_ONLY=decode GPU_CHECK_BUDGET_S=200 bash tools/gpu_check.sh      # the device call's stage decode

Systems (``megatron_ppo.rollout.generation.generate`` with these ``DecodeOptions``, everything else default):
``eager`` = ``static_step=False`` (megatron's ``GPTModel.forward`` with its static inference context every step,
today's eager step), ``static`` = the static loop without CUDA graphs (``cuda_graphs="false"``), ``graphs`` = the
static loop with one CUDA graph per batch bucket (``cuda_graphs="true"``, what ``auto`` picks on a GPU; it needs CUDA,
so a CPU run reports it 'skipped: no CUDA').

Model: random weights of ``megatron_ppo.testing.gpu_step.arch("qwen2-0.5b")`` (494 M parameters, tied embedding),
bf16, the local spec (the eager path's ragged prefill needs its SDPA core attention), TP = PP = 1. A case ``PxN`` is
P prompts of random token ids with random lengths in ``--prompt-len`` (64-128) and N new tokens per prompt:
temperature 1, ``eos_token_ids=()``, so every row makes exactly N tokens (checked).

Per system and case: ``wall_s`` of ``generate`` (``torch.cuda.synchronize`` around it; median of ``--reps``),
``tokens_per_s`` = P * N / wall, ``prefill_s`` = the wall of the same call with ``max_response_length=1`` (prefill and
one sample), ``ms_per_step`` = (wall - prefill_s) / (N - 1) decode steps (sample + bookkeeping + forward; a graph's
capture, once per rollout, is in it), ``host_reads_per_step``: outermost ``aten::_local_scalar_dense`` / ``item`` /
``nonzero`` / ``equal`` / ``is_nonzero`` / ``masked_select`` ops after the prefill (``torch.profiler``, CPU activity,
one run of ``--profile-steps`` + 1 tokens) per decode step (an ``item`` that calls ``_local_scalar_dense`` is one
read; the static loop's lagged alive count reads a pinned host copy: counted, it is its one read), and ``x_floor`` =
ms_per_step / the bandwidth floor: bf16 parameter bytes / the GPU's memory bandwidth (``--bandwidth-gbs``, default
by device name: H200 4800, H100 SXM 3350, H100 NVL 3900, H100 PCIe 2000 GB/s); the KV cache's reads are left out of
that floor (``floor_with_kv_ms`` adds the static cache's full read per step). The eager path is host-bound (its step
time: docs/bench/gpu.md): it runs at most ``--eager-max-steps`` new tokens (64) and says so; its
``tokens_per_s_full_est`` extrapolates prefill + (N - 1) steps at its measured step time.

Order: one small warm-up run per system; then per case: each system's profiled run, then ``--reps`` rounds of
(prefill run, full run) over the systems. A system whose run raises is recorded with its error and left out after
(a failed profiled run only loses its host-read count). ``--deadline-s`` skips what would start after that many
seconds; the JSON is rewritten after every case. Exit 1 when a system failed, ran out of time or a row did not make
its N tokens. Results: docs/bench/gpu.md (stage decode), where its expected time on an H100 is given too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SYSTEMS = {  # name: (DecodeOptions overrides, description)
    "eager": ({"static_step": False}, "megatron's GPTModel.forward every step (static_step=False, today's eager step)"),
    "static": ({"cuda_graphs": "false"}, "the static loop, no CUDA graphs (cuda_graphs=false)"),
    "graphs": ({"cuda_graphs": "true"}, "the static loop as one CUDA graph per bucket (cuda_graphs=true; auto's pick "
               "on a GPU)"),
}
HOST_READ_OPS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal",
                           "aten::is_nonzero", "aten::masked_select"})
BANDWIDTH_GBS = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))
DEFAULT_BANDWIDTH_GBS = 3350.0  # H100 SXM (HBM3), NVIDIA's datasheet
GOALS = (("64x256", "tokens_per_s", ">=", 20000.0, "tokens/s at 64 x 256"),
         ("256x512", "tokens_per_s", ">=", 40000.0, "tokens/s at 256 x 512"),
         ("64x256", "ms_per_step", "<=", 3.0, "ms per decode step at 64 rows"))
GPU_COMMAND = "GPU_CHECK_ONLY=decode GPU_CHECK_BUDGET_S=200 bash tools/gpu_check.sh"


# ---------------------------------------------------------------------------------------------- pure helpers

def parse_case(text: str) -> tuple[int, int]:
    """'64x256' -> (64 prompts, 256 new tokens)."""
    try:
        p, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is PROMPTSxNEW, e.g. 64x256; got {text!r}") from None
    if p < 1 or n < 2:
        raise argparse.ArgumentTypeError(f"a case needs >= 1 prompt and >= 2 new tokens (a decode step); got {text!r}")
    return p, n


def bandwidth_gbs(device_name: str, override: float | None = None) -> float:
    """The memory bandwidth (GB/s) of the floor: ``override`` if given, else by the device's name."""
    if override:
        return float(override)
    for key, gbs in BANDWIDTH_GBS:
        if key.lower() in device_name.lower():
            return gbs
    return DEFAULT_BANDWIDTH_GBS


def floor_ms(n_bytes: float, gbs: float) -> float:
    """Milliseconds to read ``n_bytes`` once at ``gbs`` GB/s (10^9 bytes/s): a decode step's lower bound, as every
    step reads every weight."""
    if gbs <= 0:
        raise ValueError(f"floor_ms: bandwidth must be positive, got {gbs}")
    return n_bytes / (gbs * 1e9) * 1e3


def kv_cache_bytes(arch, rows: int, columns: int, elem_bytes: int) -> int:
    """Bytes of a static KV cache of ``rows`` x ``columns`` (K and V, every layer): what the static decode step reads
    each step (it attends over the whole cache, masked)."""
    return 2 * arch.num_layers * arch.num_query_groups * arch.head_dim * rows * columns * elem_bytes


def decode_window(events) -> tuple[float, float] | None:
    """(start, end) in us of the decode loop in a profile of one ``generate`` wrapped in ``bench/generate``: the
    ``generate/decode_loop`` range where the loop marks one, else from the end of ``generate/prefill`` to the end of
    ``bench/generate``."""
    by_name = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e)
    if "generate/decode_loop" in by_name:
        loops = by_name["generate/decode_loop"]
        return min(e.time_range.start for e in loops), max(e.time_range.end for e in loops)
    if "generate/prefill" not in by_name or "bench/generate" not in by_name:
        return None
    return (max(e.time_range.end for e in by_name["generate/prefill"]),
            max(e.time_range.end for e in by_name["bench/generate"]))


def host_reads(events, window: tuple[float, float] | None = None) -> dict[str, int]:
    """Count by name of the outermost host-read ops (``HOST_READ_OPS``; one inside another, like ``aten::item`` ->
    ``aten::_local_scalar_dense``, is one read) that start inside ``window`` (us; None: all)."""
    counts: dict[str, int] = {}
    for e in events:
        if e.name not in HOST_READ_OPS:
            continue
        if window is not None and not window[0] <= e.time_range.start <= window[1]:
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name in HOST_READ_OPS:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def derive(prompts: int, new: int, wall_s: float, prefill_s: float, floor: float) -> dict:
    """tokens/s, ms per decode step and its ratio to the floor from one case's timings (``new`` tokens run)."""
    steps = new - 1
    ms = (wall_s - prefill_s) / steps * 1e3
    return {"decode_steps": steps, "tokens_per_s": prompts * new / wall_s, "ms_per_step": ms,
            "x_floor": ms / floor if floor > 0 else None}


def goal_results(cases: list[dict]) -> list[dict]:
    """Issue 46's goals, read on ``graphs`` (what a GPU runs by default), else ``static`` where graphs did not run."""
    out = []
    for case, key, op, target, what in GOALS:
        row = next((c for c in cases if c["case"] == case), None)
        got = system = None
        for name in ("graphs", "static"):
            s = (row or {}).get("systems", {}).get(name, {})
            if s.get(key) is not None:
                got, system = s[key], name
                break
        met = None if got is None else (got >= target if op == ">=" else got <= target)
        out.append({"goal": f"{what} {op} {target:g}", "system": system, "value": got, "met": met})
    return out


def fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def markdown(result: dict) -> str:
    """The systems x cases table and the goals, as printed and as docs/bench/gpu.md shows them."""
    lines = ["| case | system | tokens/s | wall (s) | prefill (s) | ms / decode step | x floor | host reads / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for c in result["cases"]:
        for name, s in c["systems"].items():
            if "skipped" in s or "error" in s:
                why = s.get("skipped") or f"**error**: {s['error'][:120]}"
                lines.append(f"| {c['case']} | {name} | {why} | | | | | |")
                continue
            tag = ""
            if s.get("capped"):
                tag = f" (at {s['new_tokens_run']} tokens)"
                notes.append(f"{name} at {c['case']}: timed at {s['new_tokens_run']} of {c['new']} new tokens "
                             f"(--eager-max-steps); at {c['new']} tokens, prefill + {c['new'] - 1} steps at its step "
                             f"time: ~{s['tokens_per_s_full_est']:.0f} tokens/s")
            lines.append(f"| {c['case']} | {name}{tag} | {s['tokens_per_s']:.0f} | {s['wall_s']:.3f} | "
                         f"{s['prefill_s']:.3f} | {s['ms_per_step']:.2f} | {fmt(s['x_floor'], '.1f')} | "
                         f"{fmt(s['host_reads_per_step'], '.3f')} |")
    lines.append("")
    lines += [f"- {n}" for n in notes]
    for g in result.get("goals", []):
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "**not met**")
        value = "" if g["value"] is None else f": {g['value']:.{0 if g['value'] >= 100 else 2}f} ({g['system']})"
        lines.append(f"- goal {g['goal']}{value}, {verdict}")
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- measuring

def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """``n`` prompts of random ids, lengths uniform in [lo, hi], on the CPU (as the driver hands them over)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g) for k in lengths]


class Bench:
    def __init__(self, model, device, vocab: int):
        from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams, generate

        self.model, self.device, self.vocab = model, device, vocab
        self.generate, self.params, self.options = generate, SamplingParams, DecodeOptions

    def options_of(self, system: str):
        return self.options(**SYSTEMS[system][0])

    def loop_of(self, system: str) -> str:
        """Which loop ``generate`` takes for this system on this model (the static loop falls back to megatron's
        forward, with a WARNING, for a model it does not cover: the bench says so instead of mislabelling)."""
        from megatron_ppo.models.unwrap import unwrap_model
        from megatron_ppo.rollout.decode_step import unsupported_reason

        if not self.options_of(system).static_step:
            return "megatron forward"
        reason = unsupported_reason(unwrap_model(self.model))
        return "static" if reason is None else f"megatron forward (static step does not cover: {reason})"

    def run(self, system: str, prompts, new: int, seed: int = 0):
        """(wall seconds, output) of one generate call."""
        params = self.params(max_response_length=new, temperature=1.0, eos_token_ids=(), seed=seed)
        opts = self.options_of(system)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.generate(self.model, prompts, params, opts)
        sync(self.device)
        return time.perf_counter() - t0, out

    def profile(self, system: str, prompts, new: int) -> dict:
        """Host reads in the decode loop of one run of ``new`` tokens, per decode step."""
        from torch.profiler import ProfilerActivity, profile, record_function

        params = self.params(max_response_length=new, temperature=1.0, eos_token_ids=(), seed=1)
        opts = self.options_of(system)
        sync(self.device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("bench/generate"):
                self.generate(self.model, prompts, params, opts)
            sync(self.device)
        events = prof.events()
        window = decode_window(events)
        counts = host_reads(events, window)
        return {"profile_new_tokens": new, "host_reads": counts, "host_reads_window": window is not None,
                "host_reads_per_step": sum(counts.values()) / (new - 1) if window is not None else None}


def build(dry_run: bool, transformer_impl: str):
    """(model, arch name, arch, dtype, device) for this run: the 0.5 B model in bf16 on the GPU, or (dry run) the
    tiny one in fp32 on the CPU."""
    from megatron_ppo import parallel
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.testing import gpu_step

    if dry_run:
        name, arch, dtype = "tiny", tiny_arch(), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_decode: no CUDA device (use --dry-run on a CPU machine)")
        name, arch, dtype = "qwen2-0.5b", gpu_step.arch("qwen2-0.5b"), torch.bfloat16
    parallel.initialize(tp=1, pp=1, seed=1234)
    model = build_gpt_model(arch, "actor", params_dtype=dtype, transformer_impl=transformer_impl)
    model.eval()
    device = next(model.parameters()).device
    return model, name, arch, dtype, device


def measure_case(bench: Bench, prompts_n: int, new: int, args, systems: list[str], dead: dict, floor: float,
                 deadline) -> dict:
    """One case, every system (module docstring: profiled run, then reps rounds of prefill run + full run)."""
    prompts = make_prompts(prompts_n, args.prompt_len[0], args.prompt_len[1], bench.vocab, seed=prompts_n * 7919 + new)
    case = {"case": f"{prompts_n}x{new}", "prompts": prompts_n, "new": new,
            "prompt_tokens": sum(p.numel() for p in prompts), "prompt_width": max(p.numel() for p in prompts),
            "systems": {}}
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
    run_len = {s: (min(new, args.eager_max_steps) if s == "eager" and args.eager_max_steps else new)
               for s in systems}
    state = {s: {} for s in systems}

    def attempt(system, what, fn):
        if system in dead:
            state[system] = {"skipped": dead[system]}
            return None
        if deadline():
            state[system].setdefault("skipped", f"out of time (--deadline-s {args.deadline_s:g})")
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the other systems go on
            msg = f"{what}: {type(exc).__name__}: {str(exc)[:300]}"
            print(f"decode {case['case']} {system}: FAILED {msg}\n{traceback.format_exc()[-2000:]}", flush=True)
            dead[system] = f"failed earlier ({msg[:160]})"
            state[system] = {"error": msg}
            return None

    for s in systems:  # first: also this shape's warm-up; a profiler that fails leaves the timing to go on
        if s in dead or deadline():
            continue
        k = max(2, min(run_len[s], args.profile_steps + 1))
        try:
            state[s].update(bench.profile(s, prompts, k))
        except Exception as exc:  # noqa: BLE001 - recorded; the timed runs say whether the system itself works
            print(f"decode {case['case']} {s}: profiled run FAILED {type(exc).__name__}: {exc}", flush=True)
            state[s].update(host_reads_per_step=None, host_reads_error=f"{type(exc).__name__}: {str(exc)[:300]}")
    walls = {s: [] for s in systems}
    prefills = {s: [] for s in systems}
    full_rows = {s: True for s in systems}
    for rep in range(args.reps):
        for s in systems:
            if "error" in state[s] or "skipped" in state[s]:
                continue
            got = attempt(s, "prefill run", lambda s=s: bench.run(s, prompts, 1, seed=rep))
            if got is None:
                continue
            prefills[s].append(got[0])
            got = attempt(s, "full run", lambda s=s: bench.run(s, prompts, run_len[s], seed=rep))
            if got is None:
                continue
            wall, out = got
            walls[s].append(wall)
            full_rows[s] &= bool((out.response_lengths == run_len[s]).all())
            print(f"decode {case['case']} {s}: {run_len[s]} tokens in {wall:.3f} s "
                  f"({prompts_n * run_len[s] / wall:.0f} tokens/s; prefill run {prefills[s][-1]:.3f} s)", flush=True)
    for s in systems:
        r = state[s]
        if "error" in r or "skipped" in r or not walls[s]:
            if not ("error" in r or "skipped" in r):
                r["skipped"] = f"out of time (--deadline-s {args.deadline_s:g})"
            case["systems"][s] = {k: v for k, v in r.items() if k in ("error", "skipped")}
            continue
        wall, pre = statistics.median(walls[s]), statistics.median(prefills[s])
        r.update(loop=bench.loop_of(s), new_tokens_run=run_len[s], capped=run_len[s] < new, wall_s=wall,
                 wall_s_all=walls[s], prefill_s=pre, every_row_made_its_tokens=full_rows[s])
        r.update(derive(prompts_n, run_len[s], wall, pre, floor))
        if r["capped"]:
            r["tokens_per_s_full_est"] = prompts_n * new / (pre + (new - 1) * r["ms_per_step"] / 1e3)
        case["systems"][s] = r
    if bench.device.type == "cuda":
        case["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(bench.device) / 2**30
    return case


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", type=parse_case, help="PROMPTSxNEW (default 64x256 256x512; dry run 4x8 8x16)")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--reps", type=int, default=1, help="timed rounds per case (medians)")
    p.add_argument("--eager-max-steps", type=int, help="new tokens the eager path runs at most (0: all; default 64, "
                   "dry run 8)")
    p.add_argument("--profile-steps", type=int, default=32, help="decode steps of the host-read profile run")
    p.add_argument("--prompt-len", nargs=2, type=int, metavar=("MIN", "MAX"), help="prompt lengths (64 128; dry run "
                   "4 12)")
    p.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth of the floor (default: by device name, "
                   f"H200 4800, else {DEFAULT_BANDWIDTH_GBS:g})")
    p.add_argument("--transformer-impl", default="local", choices=["local", "auto", "transformer_engine"])
    p.add_argument("--deadline-s", type=float, default=0.0, help="skip what would start later than this (0: never)")
    p.add_argument("--out", help="write the results JSON here (rewritten after every case)")
    p.add_argument("--dry-run", action="store_true", help="CPU: a tiny fp32 model, small cases; graphs skipped")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    args.cases = args.cases or ([(4, 8), (8, 16)] if args.dry_run else [(64, 256), (256, 512)])
    args.eager_max_steps = (8 if args.dry_run else 64) if args.eager_max_steps is None else args.eager_max_steps
    args.prompt_len = args.prompt_len or ([4, 12] if args.dry_run else [64, 128])
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        p.error("--prompt-len: 1 <= MIN <= MAX")
    if args.reps < 1 or args.profile_steps < 1:
        p.error("--reps and --profile-steps must be >= 1")

    def deadline() -> bool:
        return bool(args.deadline_s) and time.perf_counter() - t_start > args.deadline_s

    model, arch_name, arch, dtype, device = build(args.dry_run, args.transformer_impl)
    t_built = time.perf_counter() - t_start
    from megatron_ppo.rollout.generation import DecodeOptions

    on_cuda = device.type == "cuda"
    device_name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    gbs = bandwidth_gbs(device_name, args.bandwidth_gbs)
    n_params = arch.num_parameters()
    elem = torch.tensor([], dtype=dtype).element_size()
    floor = floor_ms(n_params * elem, gbs)
    result = {
        "tool": "tools/bench_decode.py", "command": "python tools/bench_decode.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "dry_run": args.dry_run, "device": device_name, "torch": torch.__version__, "arch": arch_name,
        "arch_fields": arch.to_dict(), "params": n_params, "dtype": str(dtype).replace("torch.", ""),
        "transformer_impl": args.transformer_impl, "param_bytes": n_params * elem, "bandwidth_gbs": gbs,
        "floor_ms": floor, "prompt_len": args.prompt_len, "reps": args.reps, "eager_max_steps": args.eager_max_steps,
        "profile_steps": args.profile_steps, "decode_options_default": dataclasses.asdict(DecodeOptions()),
        "systems": {s: {"options": SYSTEMS[s][0], "what": SYSTEMS[s][1]} for s in args.systems},
        "build_s": t_built, "warmup_s": {}, "cases": [], "goals": [],
    }
    print(f"bench_decode: {arch_name} ({n_params:,} parameters, {result['dtype']}) on {device_name}, torch "
          f"{torch.__version__}; floor {n_params * elem / 1e9:.4g} GB / {gbs:g} GB/s = {floor:.4g} ms per decode "
          f"step; built in {t_built:.1f} s", flush=True)
    bench = Bench(model, device, arch.vocab_size)
    dead: dict[str, str] = {}
    systems = list(args.systems)
    if "graphs" in systems and not on_cuda:
        dead["graphs"] = "no CUDA"
    warm = make_prompts(8, args.prompt_len[0], args.prompt_len[1], arch.vocab_size, seed=5)
    for s in systems:
        if s in dead:
            continue
        try:
            result["warmup_s"][s] = bench.run(s, warm, 16)[0]
        except Exception as exc:  # noqa: BLE001 - recorded, the others go on
            print(f"decode warm-up {s}: FAILED {type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}",
                  flush=True)
            dead[s] = f"failed in the warm-up ({type(exc).__name__}: {str(exc)[:200]})"

    def write() -> None:
        result["goals"] = [] if args.dry_run else goal_results(result["cases"])
        result["elapsed_s"] = time.perf_counter() - t_start
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")

    for prompts_n, new in args.cases:
        case = measure_case(bench, prompts_n, new, args, systems, dead, floor, deadline)
        columns = case["prompt_width"] + new  # the static cache's width: every decode step reads all of it
        case["floor_with_kv_ms"] = floor_ms(n_params * elem + kv_cache_bytes(arch, prompts_n, columns, elem), gbs)
        result["cases"].append(case)
        write()
    print(markdown(result), flush=True)
    bad = [f"{c['case']} {s}: {r.get('error') or r.get('skipped') or 'a row made fewer tokens than asked'}"
           for c in result["cases"] for s, r in c["systems"].items()
           if "error" in r or r.get("every_row_made_its_tokens") is False or "out of time" in r.get("skipped", "")]
    print(f"bench_decode: {len(result['cases'])} cases in {result['elapsed_s']:.1f} s"
          + (f"; FAILED: {'; '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
