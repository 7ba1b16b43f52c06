"""Build description of the kernel extensions in csrc/, imported by setup.py (``ext_modules, cmdclass = extensions()``).

- ``megatron_ppo._kernels_cpu``: always (C++17, -O3, OpenMP). Its row kernels carry AVX-512/AVX2/baseline clones
  chosen at load time, so the wheel runs on any x86-64.
- ``megatron_ppo._kernels_cuda``: only where torch was built with CUDA *and* nvcc is found; for Hopper
  (sm_90 SASS) plus compute_90 PTX that newer GPUs JIT-compile. ``MEGATRON_PPO_CUDA_ARCH`` adds other
  ``-gencode`` targets (e.g. ``80`` for A100), ``MEGATRON_PPO_BUILD_CUDA=0`` skips the CUDA build.

Both are optional at runtime: ``megatron_ppo.ops`` falls back to the torch reference when a .so is missing.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
CPU_SOURCES = ["csrc/cpu/gae.cpp", "csrc/cpu/logprob_entropy.cpp", "csrc/cpu/bindings.cpp"]
CUDA_SOURCES = ["csrc/cuda/gae.cu", "csrc/cuda/logprob_entropy.cu", "csrc/cuda/bindings.cpp"]
CXX_FLAGS = ["-O3", "-fopenmp"]  # torch adds -std=c++20
NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]


def cuda_gencode_flags(extra_arches: str | None = None) -> list[str]:
    """sm_90 SASS + compute_90 PTX (the fallback any newer GPU can JIT), plus extra arches like "80,89"."""
    flags = ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]
    for arch in filter(None, (a.strip() for a in (extra_arches or "").split(","))):
        if not arch.isdigit():
            raise ValueError(f"MEGATRON_PPO_CUDA_ARCH must be comma-separated numbers like '80,89', got {arch!r}")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME/CUDA_PATH, else PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def want_cuda() -> tuple[bool, str]:
    """(build the CUDA extension?, why)."""
    if os.environ.get("MEGATRON_PPO_BUILD_CUDA", "1") == "0":
        return False, "MEGATRON_PPO_BUILD_CUDA=0"
    import torch

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA"
    if find_nvcc() is None:
        return False, "nvcc not found (set CUDA_HOME)"
    return True, f"torch CUDA {torch.version.cuda}, nvcc {find_nvcc()}"


def extensions():
    """(ext_modules, cmdclass) for setuptools; CPU extension always, CUDA extension when possible."""
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    include = [str(CSRC)]
    modules = [
        CppExtension(
            "megatron_ppo._kernels_cpu",
            CPU_SOURCES,
            include_dirs=include,
            extra_compile_args=CXX_FLAGS,
            extra_link_args=["-fopenmp"],
        )
    ]
    build_cuda, why = want_cuda()
    print(f"[csrc_build] CUDA extension: {'yes' if build_cuda else 'no'} ({why})", file=sys.stderr)
    if build_cuda:
        from torch.utils.cpp_extension import CUDAExtension

        modules.append(
            CUDAExtension(
                "megatron_ppo._kernels_cuda",
                CUDA_SOURCES,
                include_dirs=include,
                extra_compile_args={
                    "cxx": ["-O3"],
                    "nvcc": NVCC_FLAGS + cuda_gencode_flags(os.environ.get("MEGATRON_PPO_CUDA_ARCH")),
                },
            )
        )
    return modules, {"build_ext": BuildExtension.with_options(use_ninja=True)}
