"""The kernel sources build: CUDA .cu files compile for sm_90 with plain nvcc (no torch, no GPU needed), the CPU
kernels compile without ATen, setup.py's extension list is what csrc_build promises, and the CPU extension that
`make setup` built is the backend ops actually uses."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import csrc_build  # noqa: E402  (kept beside setup.py)

NVCC = csrc_build.find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("source", ["csrc/cuda/gae.cu", "csrc/cuda/logprob_entropy.cu"])
def test_cuda_kernels_compile_for_sm90_with_plain_nvcc(source, tmp_path):
    obj = tmp_path / (Path(source).stem + ".o")
    cmd = [NVCC, "-c", "-O3", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-I", str(ROOT / "csrc"),
           str(ROOT / source), "-o", str(obj)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert obj.stat().st_size > 0
    symbols = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True).stdout
    entry = "mppo_cuda_gae" if "gae" in source else "mppo_cuda_lse_partials"
    assert entry in symbols  # the extern "C" launch API is there, unmangled


@pytest.mark.parametrize("source", ["csrc/cpu/gae.cpp", "csrc/cpu/logprob_entropy.cpp"])
def test_cpu_kernels_compile_without_aten(source, tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [cxx, "-c", "-O2", "-std=c++17", "-fopenmp", "-Wall", "-Werror", str(ROOT / source), "-o",
           str(tmp_path / "k.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="no CUDA toolkit")
def test_cuda_binding_compiles_against_torch_headers(tmp_path):
    """csrc/cuda/bindings.cpp (the only CUDA-side file that sees torch) passes a syntax-only compile against this
    torch's headers and the CUDA toolkit's, so API slips surface here rather than on a GPU machine. A CPU torch
    lacks one generated c10/cuda header (build-time macros only): a one-line stand-in is written for it."""
    from torch.utils.cpp_extension import include_paths

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in include_paths()):
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    import sysconfig

    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), Path(NVCC).resolve().parents[1],
             "/usr/local/cuda"]
    cuda_include = next((Path(h) / "include" for h in homes if h and (Path(h) / "include/cuda_runtime.h").exists()),
                        None)
    if cuda_include is None:
        pytest.skip("CUDA toolkit headers (cuda_runtime.h) not found")
    cmd = [shutil.which("g++") or "c++", "-std=c++20", "-fsyntax-only", "-Wall", "-Wno-c++20-extensions",
           "-DTORCH_EXTENSION_NAME=_kernels_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *[f"-I{p}" for p in include_paths()], f"-I{tmp_path}", f"-I{sysconfig.get_paths()['include']}",
           f"-I{cuda_include}", f"-I{ROOT / 'csrc'}", str(ROOT / "csrc/cuda/bindings.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]


def test_gencode_flags_target_hopper_with_ptx_fallback():
    flags = csrc_build.cuda_gencode_flags()
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert "-gencode=arch=compute_90,code=compute_90" in flags  # PTX: JIT on newer GPUs
    assert "-gencode=arch=compute_80,code=sm_80" in csrc_build.cuda_gencode_flags("80")
    with pytest.raises(ValueError, match="MEGATRON_PPO_CUDA_ARCH"):
        csrc_build.cuda_gencode_flags("sm_80")


def test_extensions_cpu_always_cuda_only_with_cuda_torch(monkeypatch):
    monkeypatch.setenv("MEGATRON_PPO_BUILD_CUDA", "0")
    modules, cmdclass = csrc_build.extensions()
    assert [m.name for m in modules] == ["megatron_ppo._kernels_cpu"]
    assert "build_ext" in cmdclass
    assert all((ROOT / s).exists() for s in modules[0].sources)
    monkeypatch.delenv("MEGATRON_PPO_BUILD_CUDA")
    build_cuda, why = csrc_build.want_cuda()
    assert build_cuda == (torch.version.cuda is not None and NVCC is not None), why
    assert all((ROOT / s).exists() for s in csrc_build.CUDA_SOURCES)


def test_built_cpu_extension_is_the_active_backend():
    from megatron_ppo import ops

    reason = ops.unavailable_reason("cpu")
    assert reason is None, f"CPU kernels not built ({reason}); run `make setup` or `python setup.py build_ext -i`"
    assert ops.backend("cpu") == "cpu"
