"""What a run directory holds besides metrics.jsonl: the resolved config, the package versions, the layout, and
GPU utilisation/memory samples (nvidia-ml-py, only when a GPU and NVML are there).

    config.yaml    the resolved config (every key, defaults included): `megatron-ppo train --config DIR/config.yaml`
                   reruns it
    versions.json  python, platform and the versions of the packages that decide the numbers
    layout.json    per role: TP x PP x DP and torch threads per rank, launcher, placement, device
"""
from __future__ import annotations

import json
import logging
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGES = ("megatron_ppo", "megatron-core", "torch", "ray", "transformers", "tokenizers", "pyarrow", "numpy",
            "matplotlib", "nvidia-ml-py")


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def layout(cfg, group_layouts: dict, threads: dict | None = None) -> dict:
    """{role: {tp, pp, dp, ranks, torch_threads}} plus the cluster keys that place them; ``threads``: {role: the
    torch thread count of each rank, as the ranks reported it}."""
    c = cfg.cluster
    threads = threads or {}
    return {"launcher": c.launcher, "placement": c.placement, "device": c.device, "nnodes": c.nnodes,
            "n_gpus_per_node": c.n_gpus_per_node, "num_cpus_per_rank": c.num_cpus_per_rank,
            "roles": {role: {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ranks": lay.tp * lay.pp * lay.dp,
                             "torch_threads": list(threads.get(role, []))}
                      for role, lay in group_layouts.items()}}


def write_run_record(log_dir: str | Path, cfg, group_layouts: dict, threads: dict | None = None) -> list[Path]:
    """config.yaml, versions.json and layout.json into the log dir (atomically; a rerun replaces them)."""
    from megatron_ppo.config import to_yaml

    d = Path(log_dir)
    d.mkdir(parents=True, exist_ok=True)
    return [_write(d / "config.yaml", to_yaml(cfg)),
            _write(d / "versions.json", json.dumps(versions(), indent=1) + "\n"),
            _write(d / "layout.json", json.dumps(layout(cfg, group_layouts, threads), indent=1) + "\n")]


class GpuMonitor:
    """perf/gpu_util (%) and perf/gpu_mem_gib (used, GiB), averaged/summed over this node's visible GPUs, when
    nvidia-ml-py imports and NVML finds a GPU; otherwise `sample()` is {} (CPU runs log nothing, never fail)."""

    def __init__(self):
        self.handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
        except Exception as e:  # noqa: BLE001 - ImportError, NVMLError (no driver / no GPU): no GPU metrics
            log.debug("no GPU metrics: %s", e)
            self.handles = []

    def sample(self) -> dict[str, float]:
        if not self.handles:
            return {}
        try:
            util = [self.nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles]
            used = [self.nvml.nvmlDeviceGetMemoryInfo(h).used for h in self.handles]
        except Exception as e:  # noqa: BLE001 - a GPU gone mid-run: stop sampling, keep training
            log.warning("NVML sampling failed (%s); no further GPU metrics", e)
            self.handles = []
            return {}
        return {"perf/gpu_util": sum(util) / len(util), "perf/gpu_mem_gib": sum(used) / 2**30}
