"""The CUDA kernels' math, run on the host: no GPU needed, only nvcc (the tests skip without it).

``tests/unit/cuda_host/harness.cu`` is compiled by nvcc as host code and runs the very ``__host__ __device__``
functions the kernels run (``csrc/cuda/lse_math.cuh``: online_add, merge, accumulate_columns, chunk_for, the
argument checks; ``csrc/cuda/gae_math.cuh``: the scan's step maps, compositions, apply and the recursion step),
arranged as a launch arranges them (blocks x threads, the warp-shuffle trees and the split merge are emulated).
Its results are compared with the CPU kernel and float64 references on the edge rows of issue 23: -inf first,
all -inf, one-hot, NaN, zero rows, one row x 151936 (split over blocks, some of them all -inf), TP shards that are all
-inf, misaligned / strided / overlapping rows; GAE at T = 1, 1023..1025 and 8193 with NaN at masked positions.
``tests/unit/cuda_host/launch_api.cpp`` links the real ``csrc/cuda/logprob_entropy.cu`` and calls its C API where
it returns before any launch (the workspace size of a [0, V] input divided by zero: SIGFPE).

``MPPO_CUDA_HOST_CSRC=<dir>`` builds both against another csrc tree (a copy of an older one: these tests fail there).
Both programs are built once per session into a temporary directory (a few seconds each).
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_ppo import ops
from megatron_ppo.ops.reference import stats_dtype
from megatron_ppo.testing.backends import use_backend

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import csrc_build  # noqa: E402  (kept beside setup.py)

sys.path.insert(0, str(Path(__file__).parent))
from test_ops_gae import gae_loop_f64  # noqa: E402  (the float64 GAE recursion the CPU parity tests use)

NVCC = csrc_build.find_nvcc()
NO_NVCC = "nvcc not found (CUDA_HOME, CUDA_PATH or PATH): the CUDA host harness is compiled with it"
CSRC = Path(os.environ.get("MPPO_CUDA_HOST_CSRC") or ROOT / "csrc").resolve()
SOURCES = Path(__file__).resolve().parent / "cuda_host"
THREADS, MIN_COLUMNS_PER_BLOCK, QUANTUM = 256, 16384, 256 * 8  # csrc/cuda/lse_math.cuh
CODE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64"}
NEG_INF = float("-inf")


def _compile(cmd: list[str], what: str) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(f"building the {what} against {CSRC} failed:\n{' '.join(cmd)}\n{result.stderr[-6000:]}")
    return time.perf_counter() - start


def _run(binary: Path, *args) -> str:
    """Runs a host program; a crash (a signal such as SIGFPE) or a refusal fails the test with its output."""
    result = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=300)
    if result.returncode < 0:
        pytest.fail(f"{binary.name} {' '.join(map(str, args))} was killed by "
                    f"{signal.Signals(-result.returncode).name}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        pytest.fail(f"{binary.name} {' '.join(map(str, args))} exited {result.returncode}\n{result.stderr}")
    return result.stdout


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


class Harness:
    def __init__(self, binary: Path, work: Path):
        self.binary, self.work = binary, work

    def lse(self, logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, temperature: float = 1.0,
            offset: int = 0, sm_count: int = 132) -> tuple[torch.Tensor, int]:
        """([4, N] statistics as lse_partials computes them, splits per row) for a [N, V] CPU tensor with any row
        stride (its memory span is passed as it is), the rows starting `offset` elements past a 64-byte boundary."""
        n_rows, vocab = logits.shape
        assert logits.stride(1) == 1 or vocab <= 1
        row_stride = logits.stride(0)
        span = torch.as_strided(logits, ((n_rows - 1) * row_stride + vocab,), (1,)) if n_rows else logits.reshape(0)
        data = torch.cat([torch.zeros(offset, dtype=logits.dtype), span]) if n_rows else span
        (self.work / "logits.bin").write_bytes(_raw(data))
        (self.work / "target.bin").write_bytes(_raw(target.to(torch.int64)))
        out_path = self.work / "stats.bin"
        stdout = _run(self.binary, "lse", CODE[logits.dtype], n_rows, vocab, row_stride, offset,
                      repr(1.0 / temperature), vocab_start, sm_count, self.work / "logits.bin",
                      self.work / "target.bin", out_path)
        splits = int(re.search(r"splits (\d+)", stdout).group(1))
        if n_rows == 0:
            return torch.empty(4, 0, dtype=stats_dtype(logits.dtype)), splits
        stats = torch.frombuffer(bytearray(out_path.read_bytes()), dtype=stats_dtype(logits.dtype))
        return stats.reshape(4, n_rows).clone(), splits

    def gae(self, rewards, values, mask, gamma, lam, algo: str) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length = rewards.shape
        dtype = rewards.dtype
        for name, t in (("r", rewards), ("v", values), ("m", mask.to(torch.uint8))):
            (self.work / f"{name}.bin").write_bytes(_raw(t))
        out_path = self.work / "gae.bin"
        _run(self.binary, "gae", CODE[dtype], algo, batch, length, repr(gamma), repr(lam), self.work / "r.bin",
             self.work / "v.bin", self.work / "m.bin", out_path)
        out = torch.frombuffer(bytearray(out_path.read_bytes()), dtype=dtype).reshape(2, batch, length).clone()
        return out[0], out[1]

    def chunk(self, n_rows: int, vocab: int, sm_count: int) -> tuple[int, int]:
        chunk, splits = re.search(r"chunk (-?\d+) splits (-?\d+)", _run(self.binary, "chunk", n_rows, vocab,
                                                                         sm_count)).groups()
        return int(chunk), int(splits)

    def valid(self, n_rows: int, vocab: int, row_stride: int, grad_row_stride: int) -> tuple[bool, bool]:
        args, grad = re.search(r"args (\d) grad (\d)", _run(self.binary, "valid", n_rows, vocab, row_stride,
                                                               grad_row_stride)).groups()
        return args == "1", grad == "1"


@pytest.fixture(scope="session")
def harness(tmp_path_factory) -> Harness:
    if NVCC is None:
        pytest.skip(NO_NVCC)
    work = tmp_path_factory.mktemp("cuda_host")
    binary = work / "harness"
    _compile([NVCC, "-std=c++17", "-O2", "-Werror", "all-warnings", "-x", "cu", f"-I{CSRC}",
              str(SOURCES / "harness.cu"), "-o", str(binary)], "CUDA host harness")
    return Harness(binary, work)


@pytest.fixture(scope="session")
def launch_api(tmp_path_factory) -> Path:
    """launch_api.cpp linked with the real logprob_entropy.cu, compiled with the extension's nvcc flags for sm_90."""
    if NVCC is None:
        pytest.skip(NO_NVCC)
    work = tmp_path_factory.mktemp("cuda_launch_api")
    binary = work / "launch_api"
    _compile([NVCC, "-std=c++17", *csrc_build.NVCC_FLAGS, "-arch=sm_90", "-Werror", "all-warnings", f"-I{CSRC}",
              str(SOURCES / "launch_api.cpp"), str(CSRC / "cuda/logprob_entropy.cu"), "-o", str(binary)],
             "launch API program")
    return binary


# ---------------------------------------------------------------------------------------------------- log-prob stats

def cpu_kernel_stats(logits, target, vocab_start=0, temperature=1.0):
    with use_backend("cpu"):
        return ops.partial_stats(logits, target, vocab_start, temperature)


def float64_stats(logits, target, vocab_start=0):
    from megatron_ppo.ops import reference

    return reference.lse_partials(logits.double(), target, vocab_start)


def assert_stats_match(got: torch.Tensor, expected: torch.Tensor, rtol: float, what: str):
    """Row by row: the max and the target logit exactly, sum-exp and the shifted sum to rtol. A row whose expected
    max is NaN (a NaN in the row; the CPU kernel and the reference put it in the max) must have a NaN sum-exp (the
    GPU's online max skips NaN, the sum does not)."""
    got, expected = got.double(), expected.double()
    for row in range(got.shape[1]):
        g, e = got[:, row], expected[:, row]
        where = f"{what}, row {row}: got {g.tolist()}, expected {e.tolist()}"
        if math.isnan(e[0]):
            assert math.isnan(g[1]), where
            continue
        assert g[0] == e[0] and (g[3] == e[3] or (math.isnan(g[3]) and math.isnan(e[3]))), where
        assert not math.isnan(g[1]) and not math.isnan(g[2]), where
        torch.testing.assert_close(g[1:3], e[1:3], rtol=rtol, atol=rtol * 1e-3, msg=lambda m: f"{where}\n{m}")


def assert_finished_match(stats: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, tol: float, what: str,
                          temperature: float = 1.0):
    """Log-prob and entropy finished from the statistics (ops.finish_stats) vs float64 log_softmax."""
    logp, ent, _ = ops.finish_stats(stats[0].double(), stats[1:].double())
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    exp_logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    exp_ent = -torch.where(p == 0, torch.zeros_like(p), p * logp_all).sum(-1)
    torch.testing.assert_close(logp, exp_logp, rtol=tol, atol=tol * 10, equal_nan=True, msg=lambda m: f"{what}\n{m}")
    torch.testing.assert_close(ent, exp_ent, rtol=tol, atol=tol * 10, equal_nan=True, msg=lambda m: f"{what}\n{m}")


RTOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float64: 1e-12}  # vs float64 on the same (rounded) logits


def edge_rows(vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """One [N, V] batch, one edge case per row: every thread's first element -inf (and a first block of
    THREADS x 16-byte vectors of -inf), -inf on alternate columns, all -inf, one-hot on and off the target, a NaN,
    a first half of -inf (whole split blocks of -inf when V is long), logits offset by 1e4, plain random."""
    gen = torch.Generator().manual_seed(seed)
    names = ["random", "-inf first", "-inf alternate", "all -inf", "one-hot at target", "one-hot elsewhere",
             "one NaN", "-inf first half", "offset 1e4", "-inf last column"]
    x = torch.randn(len(names), vocab, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (len(names),), generator=gen)
    x[1, : min(vocab, THREADS * 8 * 2)] = NEG_INF
    x[1, 0] = NEG_INF
    x[2, ::2] = NEG_INF
    x[3] = NEG_INF
    x[4] = NEG_INF
    x[4, target[4]] = 3.0
    x[5] = NEG_INF
    x[5, (target[5] + 1) % vocab] = -2.0
    if vocab == 1:
        target[5] = 0
        x[5, 0] = NEG_INF  # one column: "elsewhere" does not exist, the row is all -inf
    x[6, vocab // 3] = float("nan")
    x[7, : vocab // 2] = NEG_INF
    x[8] += 1e4
    x[9, -1] = NEG_INF
    return x.to(dtype), target, names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("vocab,offset", [(1, 0), (7, 1), (4097, 0), (4097, 1), (32768, 0), (151936, 0)])
def test_lse_edge_rows_match_cpu_kernel_and_float64(harness, dtype, vocab, offset):
    logits, target, names = edge_rows(vocab, dtype, seed=vocab)
    got, splits = harness.lse(logits, target, offset=offset)
    if vocab >= 2 * MIN_COLUMNS_PER_BLOCK:
        assert splits > 1  # the split-and-merge path (merge_splits_kernel), with whole blocks of -inf in some rows
    what = f"{dtype} V={vocab} offset={offset} rows={names}"
    assert_stats_match(got, cpu_kernel_stats(logits, target), RTOL[dtype], f"vs the CPU kernel, {what}")
    assert_stats_match(got, float64_stats(logits, target), RTOL[dtype], f"vs float64, {what}")
    assert_finished_match(got, logits, target, RTOL[dtype], what)
    all_neg_inf = names.index("all -inf")
    assert got[:3, all_neg_inf].tolist() == [NEG_INF, 0.0, 0.0]  # the CPU kernel's and the reference's (-inf, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lse_one_row_151936_split_over_blocks_matches_float64(harness, dtype):
    """The shape that splits one row the most (10 blocks of 16384 columns, then the split merge): random, one-hot,
    and -inf everywhere but the last block."""
    vocab = 151936
    gen = torch.Generator().manual_seed(7)
    for case in ("random", "one-hot", "only the last block finite"):
        x = torch.randn(1, vocab, generator=gen, dtype=torch.float64) * 4
        target = torch.randint(0, vocab, (1,), generator=gen)
        if case == "one-hot":
            x[:] = NEG_INF
            x[0, target] = 0.5
        elif case == "only the last block finite":
            x[0, : vocab - 1000] = NEG_INF
        logits = x.to(dtype)
        got, splits = harness.lse(logits, target, temperature=0.7)
        assert splits == math.ceil(vocab / MIN_COLUMNS_PER_BLOCK)
        assert_stats_match(got, cpu_kernel_stats(logits, target, temperature=0.7), RTOL[dtype], case)
        assert_finished_match(got, logits, target, RTOL[dtype], case, temperature=0.7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_lse_tp_shard_rows_all_neg_inf_reassemble(harness, dtype):
    """Two vocabulary shards per row; a shard row that is all -inf (banned vocabulary) must contribute (-inf, 0, 0):
    before the fix the GPU gave (-inf, NaN, 0) and the SUM all-reduce spread NaN to the whole row."""
    vocab, half = 6000, 3000
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, vocab, generator=gen, dtype=torch.float64) * 3
    target = torch.tensor([10, 4000, 20, 5999])
    x[0, half:] = NEG_INF  # shard 1 all -inf
    x[1, :half] = NEG_INF  # shard 0 all -inf
    x[2, :] = NEG_INF
    x[2, 20] = 1.0         # one-hot on shard 0, shard 1 all -inf
    logits = x.to(dtype)
    shards = []
    for start in (0, half):
        shard = logits[:, start:start + half]
        got, _ = harness.lse(shard, target, vocab_start=start)
        assert_stats_match(got, cpu_kernel_stats(shard, target, start), RTOL[dtype], f"shard at {start}")
        shards.append(got)
    global_max = torch.maximum(shards[0][0], shards[1][0])
    summed = ops.rebase_stats(shards[0], global_max) + ops.rebase_stats(shards[1], global_max)
    assert_finished_match(torch.cat([global_max[None], summed]), logits, target, RTOL[dtype], f"TP {dtype}")


def test_lse_zero_rows_give_the_empty_result(harness):
    """[0, V]: the launch shape and the statistics are computed without dividing by N = 0 (SIGFPE before the fix),
    and the result is the CPU path's empty [4, 0]."""
    logits, target = torch.empty(0, 1000), torch.empty(0, dtype=torch.int64)
    got, _ = harness.lse(logits, target)
    assert got.shape == (4, 0) == cpu_kernel_stats(logits, target).shape
    for n_rows, vocab, sm in [(0, 1000, 132), (0, 151936, 132), (0, 1, 0)]:
        chunk, splits = harness.chunk(n_rows, vocab, sm)
        assert splits >= 1 and chunk % QUANTUM == 0 and chunk * splits >= vocab


@pytest.mark.parametrize("n_rows,vocab,sm,splits", [(1, 151936, 132, 10), (9, 151936, 132, 10), (100, 151936, 132, 6),
                                                    (528, 151936, 132, 1), (4, 4096, 132, 1), (1, 1, 132, 1)])
def test_lse_launch_shape(harness, n_rows, vocab, sm, splits):
    chunk, got_splits = harness.chunk(n_rows, vocab, sm)
    assert got_splits == splits and chunk % QUANTUM == 0 and chunk * splits >= vocab > chunk * (splits - 1)


@pytest.mark.parametrize("n_rows,vocab,row_stride,grad_row_stride,args_ok,grad_ok", [
    (1, 1000, 3, 3, True, True),            # [1, V] with stride(0) < V: torch calls it contiguous (issue 23)
    (1, 1000, 1000, 1000, True, True),
    (4, 1000, 1000, 1000, True, True),
    (4, 1000, 1024, 1000, True, True),
    (4, 1000, 0, 1000, True, True),         # expanded rows: only read, allowed as on the CPU
    (4, 1000, 0, 0, True, False),           # ... but gradient rows written over each other are refused
    (0, 1000, 0, 0, True, True),
    (2, 0, 0, 0, False, True),
])
def test_lse_argument_checks(harness, n_rows, vocab, row_stride, grad_row_stride, args_ok, grad_ok):
    assert harness.valid(n_rows, vocab, row_stride, grad_row_stride) == (args_ok, grad_ok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lse_strided_rows_match_cpu_kernel(harness, dtype):
    """A single row whose stride(0) < V, rows further apart than V, and expanded (stride 0) rows."""
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(5000, generator=gen) * 3).to(dtype)
    target = torch.tensor([17, 999, 0])
    cases = {
        "one row, stride(0) = 3": torch.as_strided(base, (1, 1000), (3, 1)),
        "rows 1031 apart": torch.as_strided(base, (3, 1000), (1031, 1)),
        "expanded rows": torch.as_strided(base, (3, 1000), (0, 1)),
    }
    for name, logits in cases.items():
        tgt = target[: logits.shape[0]]
        got, _ = harness.lse(logits, tgt)
        assert_stats_match(got, cpu_kernel_stats(logits, tgt), RTOL[dtype], name)


# -------------------------------------------------------------------------------------------------------------- GAE

def gae_inputs(batch, length, dtype, mask_kind, seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    if mask_kind == "full":
        mask = torch.ones(batch, length, dtype=torch.bool)
    elif mask_kind == "ragged":
        lengths = torch.randint(0, length + 1, (batch,), generator=gen)
        lengths[0] = length
        mask = torch.arange(length)[None] < lengths[:, None]
    else:  # holes, an all-masked last row, and garbage at masked positions that must not leak
        mask = torch.rand(batch, length, generator=gen) < 0.7
        mask[-1] = False
        rewards[~mask] = float("nan")
        values[~mask] = float("inf")
    return rewards.to(dtype), values.to(dtype), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 1023), (2, 1024), (3, 1025), (2, 8193)])
@pytest.mark.parametrize("mask_kind", ["full", "ragged", "holes"])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_gae_scan_and_serial_match_cpu_kernel_and_float64(harness, dtype, shape, mask_kind, gamma, lam):
    rewards, values, mask = gae_inputs(*shape, dtype, mask_kind, seed=shape[1] + len(mask_kind))
    clean_r = torch.where(mask, rewards, torch.zeros_like(rewards))
    clean_v = torch.where(mask, values, torch.zeros_like(values))
    exp_adv, exp_ret = gae_loop_f64(clean_r, clean_v, mask, gamma, lam)
    with use_backend("cpu"):
        cpu_adv, cpu_ret = ops.gae(clean_r, clean_v, mask, gamma, lam)
    # float32, relative to the largest advantage: measured <= 1.5e-6 (serial, T = 8193, gamma = lam = 1: a sum of
    # 8193 terms), <= 4e-7 for the scan and for gamma * lam < 1
    scale = float(exp_adv.abs().max().clamp(min=1.0))
    tol = 1e-11 if dtype == torch.float64 else 5e-6
    for algo in ("scan", "serial"):
        adv, ret = harness.gae(rewards, values, mask, gamma, lam, algo)  # NaN/inf at masked positions: no leak
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), algo
        assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all(), algo
        for got, cpu, exp in ((adv, cpu_adv, exp_adv), (ret, cpu_ret, exp_ret)):
            torch.testing.assert_close(got.double(), exp, rtol=tol, atol=tol * scale, msg=lambda m: f"{algo}: {m}")
            torch.testing.assert_close(got.double(), cpu.double(), rtol=tol, atol=tol * scale,
                                       msg=lambda m: f"{algo} vs the CPU kernel: {m}")


def test_gae_scan_equals_serial_within_a_thread(harness):
    """At T = 4 every step is thread 0's (4 steps a thread): the scan composes only identity maps after it, so its
    replay starts from (0, 0) and is bitwise the serial kernel."""
    rewards, values, mask = gae_inputs(4, 4, torch.float32, "full", seed=11)
    scan = harness.gae(rewards, values, mask, 0.99, 0.95, "scan")
    serial = harness.gae(rewards, values, mask, 0.99, 0.95, "serial")
    assert torch.equal(scan[0], serial[0]) and torch.equal(scan[1], serial[1])


# ------------------------------------------------------------------------------------------------------- launch API

@pytest.mark.parametrize("n_rows,vocab,dtype,expected", [
    (0, 1000, "f32", 0), (0, 151936, "f64", 0), (0, 1, "bf16", 0),   # before the fix: SIGFPE
    (1, 151936, "f32", 1 * 10 * 3 * 4), (1, 151936, "f64", 1 * 10 * 3 * 8), (528, 151936, "f32", 0), (3, 100, "f32", 0),
])
def test_workspace_bytes_of_the_real_kernel_file(launch_api, n_rows, vocab, dtype, expected):
    out = _run(launch_api, "workspace", n_rows, vocab, dtype, 132)
    assert int(re.search(r"bytes (\d+)", out).group(1)) == expected


def test_zero_rows_launch_nothing_and_succeed(launch_api):
    out = _run(launch_api, "zero_rows", 1000)
    assert re.search(r"partials (-?\d+) backward (-?\d+)", out).groups() == ("0", "0")  # cudaSuccess, no launch


def test_cuda_binding_checks_the_device_before_the_guard():
    """c10::cuda::CUDAGuard on a CPU tensor's device is an internal assert: every binding function checks that its
    tensors are CUDA tensors (directly or through describe) before it builds the guard."""
    source = (CSRC / "cuda/bindings.cpp").read_text()
    describe = source[source.index("mppo_logits describe("):]
    assert "is_cuda()" in describe[: describe.index("\n}\n")]
    guards = [m.start() for m in re.finditer(r"CUDAGuard guard", source)]
    assert len(guards) == 3  # gae, lse_partials, lse_backward
    for guard in guards:
        function_so_far = source[source.rindex("\n}\n", 0, guard):guard]
        assert "is_cuda()" in function_so_far or "describe(" in function_so_far, function_so_far
