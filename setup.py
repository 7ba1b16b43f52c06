"""megatron_ppo: PPO RLHF on Megatron-core.

The C++ (CPU) kernel extension in csrc/ is built whenever its sources exist; the CUDA one only where torch has
CUDA and nvcc is on PATH (see build_extensions() below, owned by the kernels work in csrc/).
"""
import os
import sys

from setuptools import find_packages, setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

INSTALL_REQUIRES = [
    # torch is pinned through constraints-cpu.txt on CPU machines (the local CPU wheel); GPU clusters bring their own.
    "torch>=2.6",
    # 0.16.1 through 0.19.x (megatron_ppo/compat/mcore.py holds every difference; CI tests 0.16.1 and 0.19.2). On
    # Python 3.11 pip resolves 0.16.1, the newest that declares 3.11; GPU containers (Python 3.12) keep theirs.
    # 0.18+ imports triton at `import megatron.core`: the `triton` extra (CUDA torch wheels already bring it).
    "megatron-core>=0.16.1,<0.20",
    "ray[default]>=2.41",
    "pyarrow>=19",
    "numpy>=2.0",
    "pyyaml>=6",
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "transformers>=5.5.3,<5.11",
    "psutil",  # megatron dist_checkpointing hangs on save without it
    "tqdm",  # megatron's inference engine imports it
    "rich",
    "matplotlib>=3.8",  # the run directory's PNG curves (trainer/plots.py); pure CPU wheels, nothing CUDA
]

EXTRAS = {
    "test": [
        "pytest>=8",
        "pytest-timeout",
        "hypothesis>=6",
        "verl==0.9.1",  # the numerical oracle: imported only by tests
        "gguf",  # SmolLM2-135M ships as GGUF
        "accelerate",
        "pybind11",
        "ninja",
    ],
    "gpu": ["transformer-engine[pytorch]", "nvidia-ml-py", "triton"],
    "triton": ["triton"],  # megatron-core 0.18+ on a machine whose torch does not bring triton (CPU torch)
    "tracking": ["tensorboard", "wandb", "swanlab"],
}


def build_extensions():
    """Return (ext_modules, cmdclass) for the kernels in csrc/; empty when there is nothing to build."""
    try:
        from csrc_build import extensions  # noqa: WPS433 (kept beside setup.py, owned by the kernels work)
    except ImportError:
        return [], {}
    return extensions()


ext_modules, cmdclass = build_extensions()

setup(
    name="megatron_ppo",
    version="0.1.0",
    description="PPO RLHF trainer for large language models on Megatron-core",
    packages=find_packages(include=["megatron_ppo", "megatron_ppo.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["megatron-ppo=megatron_ppo.cli:main"]},
)
