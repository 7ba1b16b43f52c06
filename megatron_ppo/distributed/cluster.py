"""Connect to a Ray cluster or start a local one, and shut down what we started.

``connect_or_start(address)``: an explicit address (from the config) wins, then ``RAY_ADDRESS``; without either a
local cluster starts in a per-run temp dir (so concurrent runs and test sessions never share sessions or sockets),
without the dashboard (it is ~100 MB we do not use; pass include_dashboard=True for ``ray.util.state``).
Ray's log de-duplication is off by default: it folds lines that differ only in numbers ("rank 0" ... "rank 3")
into one, which hides exactly the per-rank output a failing run needs.
``RayCluster.shutdown()`` disconnects; a cluster we started stops with it and its temp dir is removed.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["RayCluster", "connect_or_start"]


@dataclass
class RayCluster:
    address: str  # the GCS address another driver can connect to
    started_here: bool
    temp_dir: str | None
    init_seconds: float

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.started_here and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def connect_or_start(address: str | None = None, num_cpus: float | None = None, num_gpus: float | None = None, *,
                     include_dashboard: bool = False, object_store_memory: int | None = None,
                     log_to_driver: bool = True, dedup_logs: bool = False) -> RayCluster:
    """ray.init against ``address`` / ``$RAY_ADDRESS``, else a fresh local cluster with ``num_cpus`` CPUs."""
    _set_log_dedup(dedup_logs)
    import ray

    if ray.is_initialized():
        raise RuntimeError("connect_or_start: Ray is already initialised in this process; shut it down first")
    address = address or os.environ.get("RAY_ADDRESS") or None
    start = time.perf_counter()
    if address and address != "local":
        if num_cpus is not None or num_gpus is not None:
            logger.warning("connect_or_start: num_cpus/num_gpus=%s/%s ignored: connecting to the existing cluster "
                           "at %s, whose resources are its own", num_cpus, num_gpus, address)
        ctx = ray.init(address=address, log_to_driver=log_to_driver)
        return RayCluster(ctx.address_info["gcs_address"], False, None, time.perf_counter() - start)
    temp_dir = tempfile.mkdtemp(prefix="ray-mppo-")
    try:
        ctx = ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=include_dashboard,
                       object_store_memory=object_store_memory, log_to_driver=log_to_driver, _temp_dir=temp_dir)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return RayCluster(ctx.address_info["gcs_address"], True, temp_dir, time.perf_counter() - start)


def _set_log_dedup(enabled: bool) -> None:
    """Ray reads RAY_DEDUP_LOGS once, when ``ray`` is imported; if it already is, set the flag it read."""
    import sys

    os.environ["RAY_DEDUP_LOGS"] = "1" if enabled else "0"
    ray_logging = sys.modules.get("ray._private.ray_logging")
    if ray_logging is not None:
        if hasattr(ray_logging, "RAY_DEDUP_LOGS"):
            ray_logging.RAY_DEDUP_LOGS = enabled
        else:
            logger.warning("connect_or_start: cannot set Ray's log de-duplication in this Ray version")
