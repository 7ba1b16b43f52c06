#!/usr/bin/env python
"""Benchmark the kernels behind megatron_ppo.ops against the paths they replace; prints a markdown section and
optionally writes it (--out). Every ratio is measured side by side in one run: methods are interleaved round by
round and the median per method is reported.

  GAE [B, T]: verl 0.9.1's compute_gae_advantage_return (Python loop over T, + whitening), algo's torch loop
              (the ops reference), the kernel called directly, and ops.gae (the front door, with its value checks)
              with a float32 mask (what the trainer passes) and a bool mask; on CUDA also the raw kernel per
              algorithm (serial/scan) against the memory-bandwidth floor (bytes in + out over a measured device
              copy bandwidth).
  log-prob + entropy [N, V]: naive log_softmax + gather + entropy (float32 [N, V] intermediates), chunked torch
              (the ops reference), verl's chunked functions, the fused kernel (+ in-place backward); time and peak
              extra memory for forward only (old/ref log-probs) and forward + backward (training). CPU peaks
              come from a child process whose malloc returns every block > 64 KiB to the OS at once, so the RSS
              high-water mark is that of live tensors.

Usage: python tools/bench_kernels.py [--device cpu|cuda|all] [--out docs/bench/kernels.md] [--append]
                                    [--skip-logprob]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ppo import ops  # noqa: E402
from megatron_ppo.algo import checks  # noqa: E402
from megatron_ppo.algo.advantages import compute_gae_advantage_return as algo_gae  # noqa: E402
from megatron_ppo.ops import _backend, reference  # noqa: E402

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------------------
# measurement


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(methods: dict[str, Callable[..., object]], device: torch.device, reps: int,
                      warmup: int = 1, setup: Callable[[], tuple] = tuple) -> dict[str, float]:
    """Median wall time (s) per method; methods alternate within each round so load drifts hit all alike.
    ``setup()`` (untimed) makes each call's arguments."""
    for fn in methods.values():
        for _ in range(warmup):
            fn(*setup())
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            args = setup()
            synchronize(device)
            start = time.perf_counter()
            fn(*args)
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
            del args
    return {name: statistics.median(v) for name, v in samples.items()}


def _proc_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Peak memory above what was live when fn started, in MiB, for everything fn allocates (outputs included).
    CUDA: the caching allocator's peak. CPU: the process high-water mark (VmHWM, reset through clear_refs);
    torch hands blocks this large straight back to the OS, so RSS tracks live tensors."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del result
        return peak / MiB
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    base = _proc_mib("VmRSS")
    result = fn()
    peak = _proc_mib("VmHWM") - base
    del result
    return peak


@contextlib.contextmanager
def ops_mode(mode: str):
    previous = _backend.set_mode(mode)
    try:
        yield
    finally:
        _backend.set_mode(previous)


@contextlib.contextmanager
def value_checks(enabled: bool):
    previous = checks.set_value_checks(enabled)
    try:
        yield
    finally:
        checks.set_value_checks(previous)


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


# ---------------------------------------------------------------------------------------------------------------
# GAE


def gae_inputs(batch: int, length: int, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)  # ragged responses
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return rewards.to(device), values.to(device), mask.to(device)


def verl_available() -> bool:
    """verl 0.9.1 is a test dependency here; a bare GPU image may lack it (then its rows are left out)."""
    try:
        import verl  # noqa: F401
    except ImportError:
        return False
    return True


def bench_gae(device: torch.device, batch: int, length: int, reps: int) -> list[str]:
    """Python loops against the kernel: raw (no Python checks) and through the front door ``ops.gae`` with the mask
    dtype the trainer passes (float32 ``response_mask``) and with a bool mask, all in one interleaved run."""
    rewards, values, mask = gae_inputs(batch, length, device)
    mask_f = mask.float()
    gamma, lam = 1.0, 0.95
    kernels = _backend.extension(device.type)

    def front_door(m, checked=True):
        def run():
            with ops_mode("kernels"), value_checks(checked):
                return ops.gae(rewards, values, m, gamma, lam)
        return run

    def kernel_direct():
        if device.type == "cuda":
            return kernels.gae(rewards, values, mask, gamma, lam, torch.float32, 0)
        return kernels.gae(rewards, values, mask, gamma, lam, torch.float32)

    methods = {}
    if verl_available():
        from verl.trainer.ppo.core_algos import compute_gae_advantage_return as verl_gae

        methods["verl `compute_gae_advantage_return` (loop over T, + whitening; float mask)"] = lambda: verl_gae(
            rewards, values, mask_f, gamma, lam)
    loop = "algo `compute_gae_advantage_return` (torch loop over T; ops reference; float mask)"
    methods[loop] = lambda: algo_gae(rewards, values, mask_f, gamma, lam)
    methods["`kernels.gae` direct (bool mask, no Python checks, counts not read)"] = kernel_direct
    methods["`ops.gae`, **float32 mask** (the trainer's `response_mask`), value checks on"] = front_door(mask_f)
    methods["`ops.gae`, bool mask, value checks on"] = front_door(mask)
    methods["`ops.gae`, float32 mask, value checks off"] = front_door(mask_f, checked=False)
    times = interleaved_times(methods, device, reps)
    kernel_times: dict[str, float] = {}
    floor_line = ""
    if device.type == "cuda":
        kernel_times, floor_line = bench_gae_cuda_kernels(rewards, values, mask, gamma, lam, reps)
    base = times[next(iter(methods))]
    threads = torch.get_num_threads()
    where = (f"CPU, {threads} threads" if device.type == "cpu" else torch.cuda.get_device_name(device))
    lines = [
        f"### GAE, B={batch}, T={length}, float32 rewards/values, ragged mask ({where})",
        "",
        "The mask dtype of each row is named: the trainer passes a float32 `response_mask`.",
        "",
        f"| method | time (ms) | speed-up vs {'verl' if verl_available() else 'the torch loop (verl not installed)'} "
        "| speed-up vs the torch loop |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in {**times, **kernel_times}.items():
        lines.append(f"| {name} | {fmt_ms(t)} | {base / t:.1f}x | {times[loop] / t:.1f}x |")
    if floor_line:
        lines += ["", floor_line]
    return lines + [""]


def bench_gae_cuda_kernels(rewards, values, mask, gamma, lam, reps):
    """Raw launches (no Python checks) per algorithm, L2 flushed before each, timed with CUDA events."""
    kernels = _backend.extension("cuda")
    out_dtype = torch.float32
    flush = torch.empty(512 * MiB, dtype=torch.uint8, device=rewards.device)  # > the 60 MB L2

    def event_time(fn) -> float:
        samples = []
        for _ in range(max(reps, 20)):
            flush.zero_()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3)
        return statistics.median(samples)

    results = {}
    for name, algo in (("serial", 1), ("scan", 2)):
        fn = lambda a=algo: kernels.gae(rewards, values, mask, gamma, lam, out_dtype, a)  # noqa: E731
        fn()
        results[f"CUDA kernel `{name}` (raw launch, L2 flushed)"] = event_time(fn)
    bandwidth = copy_bandwidth(rewards.device)
    n_bytes = rewards.numel() * (rewards.element_size() + values.element_size() + 1 + 2 * 4)
    floor = n_bytes / bandwidth
    best = min(results.values())
    line = (f"Memory-bandwidth floor: {n_bytes / 1e6:.1f} MB in + out at a measured copy bandwidth of "
            f"{bandwidth / 1e12:.2f} TB/s = {floor * 1e6:.1f} us; best kernel {best * 1e6:.1f} us = "
            f"{best / floor:.2f}x the floor (goal <= 2x).")
    return results, line


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (2 GiB buffers)."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    stop.record()
    stop.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(stop) / 1e3)


# ---------------------------------------------------------------------------------------------------------------
# log-prob + entropy


def logits_inputs(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
    """bf16/fp32 logits filled chunk by chunk (no float32 [N, V] temporary) and target ids."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.empty(n_rows, vocab, dtype=dtype, device=device)
    step = max(1, (64 * MiB) // (4 * vocab))
    for start in range(0, n_rows, step):
        chunk = torch.randn(min(step, n_rows - start), vocab, generator=gen, device=device)
        logits[start:start + step] = (chunk * 3).to(dtype)
    target = torch.randint(0, vocab, (n_rows,), generator=gen, device=device)
    return logits, target


def logprob_methods(target: torch.Tensor):
    def naive(x):
        return reference.logprobs_entropy_naive(x, target)

    def chunked_torch(x):
        return ops.token_logprobs_entropy(x, target)  # run under ops_mode("reference")

    def verl_chunked(x):
        from verl.utils import torch_functional as verl_F

        return verl_F.logprobs_from_logits(x, target), verl_F.entropy_from_logits_with_chunking(x)

    def fused(x):
        return ops.token_logprobs_entropy(x, target)

    def fused_inplace(x):
        return ops.token_logprobs_entropy(x, target, inplace_backward=True)

    methods = {
        "naive `log_softmax` + gather + entropy (fp32 [N, V])": ("auto", naive),
        "chunked torch (`ops` reference, 64 MiB chunks)": ("reference", chunked_torch),
        "verl `logprobs_from_logits` + `entropy_from_logits_with_chunking`": ("auto", verl_chunked),
        "fused kernel `ops.token_logprobs_entropy`": ("kernels", fused),
        "fused kernel, `inplace_backward=True`": ("kernels", fused_inplace),
    }
    if not verl_available():
        methods = {k: v for k, v in methods.items() if "verl" not in k}
    return methods


def logprob_runners(logits: torch.Tensor, target: torch.Tensor, skip: tuple[str, ...] = ()):
    """{name: (forward(), forward_backward(x))}; x is a fresh non-leaf copy of the logits made by the caller
    (it stands in for the LM head's output, which an in-place backward may overwrite)."""
    methods = {k: v for k, v in logprob_methods(target).items() if not any(s in k for s in skip)}

    def forward(mode, fn):
        def run():
            with ops_mode(mode), torch.no_grad():
                return fn(logits)
        return run

    def forward_backward(mode, fn):
        def run(x):
            with ops_mode(mode):
                logp, ent = fn(x)
                loss = logp.float().sum() - 0.01 * ent.float().sum()
                (grad,) = torch.autograd.grad(loss, x)
            return grad
        return run

    return {name: (forward(*spec), forward_backward(*spec)) for name, spec in methods.items()}


def logprob_peaks(logits, target, skip, device) -> dict[str, tuple[float, float]]:
    """{name: (forward peak MiB, forward+backward peak MiB)} above the inputs."""
    leaf = logits.requires_grad_()
    peaks = {}
    for name, (fwd, fwd_bwd) in logprob_runners(logits, target, skip).items():
        fwd()  # warm-up: one-time allocations (thread pools, kernels' first call) are not the op's peak
        forward_peak = peak_extra_mib(fwd, device)
        x = leaf.clone()
        fwd_bwd(x)
        backward_peak = peak_extra_mib(lambda: fwd_bwd(x), device)
        del x
        peaks[name] = (forward_peak, backward_peak)
    return peaks


def logprob_peaks_subprocess(n_rows, vocab, dtype, skip) -> dict[str, tuple[float, float]]:
    """CPU peaks measured in a child whose glibc malloc hands every block > 64 KiB back to the OS at once
    (MALLOC_MMAP_THRESHOLD_), so that the high-water mark of RSS is the high-water mark of live tensors."""
    import json
    import subprocess

    cmd = [sys.executable, __file__, "--_peaks-json", "--rows-cpu", str(n_rows), "--vocab", str(vocab),
           "--dtype", str(dtype).replace("torch.", "")] + [f"--skip={s}" for s in skip]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"peak-memory child failed:\n{result.stderr[-4000:]}")
    return {k: tuple(v) for k, v in json.loads(result.stdout.strip().splitlines()[-1]).items()}


def bench_logprob(device: torch.device, n_rows: int, vocab: int, dtype: torch.dtype, reps: int,
                  skip: tuple[str, ...] = ()) -> list[str]:
    logits, target = logits_inputs(n_rows, vocab, dtype, device)
    leaf = logits.requires_grad_()
    runners = logprob_runners(logits, target, skip)
    t_fwd = interleaved_times({n: r[0] for n, r in runners.items()}, device, reps)
    t_fwd_bwd = interleaved_times({n: r[1] for n, r in runners.items()}, device, reps,
                                  setup=lambda: (leaf.clone(),))
    if device.type == "cpu":
        peaks = logprob_peaks_subprocess(n_rows, vocab, dtype, skip)
    else:
        peaks = logprob_peaks(logits, target, skip, device)

    naive = next(iter(runners))
    where = (f"CPU, {torch.get_num_threads()} threads" if device.type == "cpu"
             else torch.cuda.get_device_name(device))
    lines = [
        f"### Log-prob + entropy, N={n_rows}, V={vocab}, {str(dtype).replace('torch.', '')} logits ({where})",
        "",
        f"Inputs: logits {logits.numel() * logits.element_size() / MiB:.0f} MiB. Peak = memory above the inputs "
        "at the op's high-water mark, outputs and the logits gradient included. fwd+bwd starts from a non-leaf "
        "copy of the logits (made outside the timing), as an LM head's output would be.",
        "",
        "| method | fwd (ms) | fwd+bwd (ms) | fwd peak (MiB) | fwd+bwd peak (MiB) | peak vs naive fwd / fwd+bwd |"
        " time vs naive fwd / fwd+bwd |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in runners:
        (m_fwd, m_bwd), (n_fwd, n_bwd) = peaks[name], peaks[naive]
        lines.append(
            f"| {name} | {fmt_ms(t_fwd[name])} | {fmt_ms(t_fwd_bwd[name])} | {max(m_fwd, 0):.0f} | "
            f"{max(m_bwd, 0):.0f} | {max(m_fwd, 0) / n_fwd:.3f} / {max(m_bwd, 0) / n_bwd:.3f} | "
            f"{t_fwd[naive] / t_fwd[name]:.2f}x / {t_fwd_bwd[naive] / t_fwd_bwd[name]:.2f}x |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------------------------


def header(argv: list[str]) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return [
        f"Command: `python tools/bench_kernels.py {' '.join(argv)}`",
        "",
        f"Machine: {cpu}, {os.cpu_count()} cores (load average {os.getloadavg()[0]:.1f} at the start: the "
        f"machine may be shared); torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d')}. Backends: cpu={ops.backend('cpu')}"
        + (f", cuda={ops.backend('cuda')}" if torch.cuda.is_available() else ""),
        "",
    ]


GPU_MARKER = "<!-- gpu-results: tools/gpu_check.sh replaces everything below this line -->"


def record_gpu_section(page: Path, gpu_markdown: str) -> None:
    """Put a GPU run's section under GPU_MARKER of the benchmark page (the CPU part above it is kept)."""
    text = page.read_text() if page.exists() else ""
    head = text.split(GPU_MARKER)[0].rstrip("\n")
    page.write_text(f"{head}\n\n{GPU_MARKER}\n\n## GPU (tools/gpu_check.sh, {time.strftime('%Y-%m-%d')})\n\n"
                    f"{gpu_markdown.strip()}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="cpu")
    parser.add_argument("--gae-batch", type=int, default=1024)
    parser.add_argument("--gae-length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2 vocabulary")
    parser.add_argument("--rows-cpu", type=int, default=1024,
                        help="N on CPU (16384 would need ~60 GiB for the naive path on a 24 GiB machine)")
    parser.add_argument("--rows-cuda", type=int, default=16384)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip", action="append", default=[], help="skip log-prob methods whose name contains this")
    parser.add_argument("--skip-logprob", action="store_true", help="GAE only")
    parser.add_argument("--out", type=Path, help="write (or with --append, append) the markdown here")
    parser.add_argument("--append", action="store_true")
    parser.add_argument("--_peaks-json", action="store_true", help=argparse.SUPPRESS)  # child of the CPU run
    parser.add_argument("--record-gpu", type=Path, metavar="GPU_MD",
                        help=f"replace everything after '{GPU_MARKER}' in --out with this GPU section, then exit")
    args = parser.parse_args(argv)
    if args.record_gpu:
        if not args.out:
            parser.error("--record-gpu needs --out (the benchmark page to update)")
        record_gpu_section(args.out, args.record_gpu.read_text())
        return 0
    if args._peaks_json:
        import json

        logits, target = logits_inputs(args.rows_cpu, args.vocab, getattr(torch, args.dtype), torch.device("cpu"))
        print(json.dumps(logprob_peaks(logits, target, tuple(args.skip), torch.device("cpu"))))
        return 0

    devices = [torch.device("cpu")] if args.device in ("cpu", "all") else []
    if args.device in ("cuda", "all"):
        if not torch.cuda.is_available():
            if args.device == "cuda":
                parser.error("--device cuda but torch sees no GPU")
        else:
            devices.append(torch.device("cuda"))
    dtype = getattr(torch, args.dtype)
    lines = header(argv)
    for device in devices:
        print(f"[bench_kernels] GAE on {device} ...", file=sys.stderr, flush=True)
        lines += bench_gae(device, args.gae_batch, args.gae_length, args.reps)
        if args.skip_logprob:
            continue
        rows = args.rows_cpu if device.type == "cpu" else args.rows_cuda
        print(f"[bench_kernels] log-prob + entropy on {device} (N={rows}) ...", file=sys.stderr, flush=True)
        lines += bench_logprob(device, rows, args.vocab, dtype, args.reps, tuple(args.skip))
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a" if args.append else "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
