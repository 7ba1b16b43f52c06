"""Connect to a Ray cluster or start a local one, and shut down what we started.

``connect_or_start(address)``: an explicit address (from the config) wins, then ``RAY_ADDRESS``; without either a
local cluster starts in a per-run temp dir (so concurrent runs and test sessions never share sessions or sockets),
without the dashboard (its processes cost memory for nothing we use; pass include_dashboard=True for
``ray.util.state``).
Ray's log de-duplication is off by default: it folds lines that differ only in numbers ("rank 0" ... "rank 3")
into one, which hides exactly the per-rank output a failing run needs.
Ray's own start-up chatter is configured away (``ray_quiet_env`` and ``logging_level``, see there): a user should
see our lines and the ranks' output and errors, not Ray's notes to cluster operators. ``--verbose`` keeps Ray's.
``RayCluster.shutdown()`` disconnects; a cluster we started stops with it and its temp dir is removed.

Temp files of the ranks: a local cluster's processes (GCS, raylet, and so every rank) get ``TMPDIR`` inside that
temp dir, so what they leave in it goes with it. Ranks end by ``ray.kill``, which runs no exit handlers: the module
-level ``TemporaryDirectory`` objects of wandb (imported by megatron.core, ``tmp*wandb-media``/``-artifacts``) and
the ``pymp-*`` dirs of dist_checkpointing's multiprocessing Manager used to stay in the user's ``$TMPDIR``, two to
three per rank and run. torch's compile cache (``torchinductor_<user>``, reused by every run) stays where it was.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
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


def ray_quiet_env(start_local: bool, stdout_is_terminal: bool) -> dict[str, str]:
    """Environment for ray.init that keeps Ray's notes off the console (set only where the user has not set them).

    - RAY_USAGE_STATS_ENABLED=0: no usage-stats prompt or upload (clusters often cannot reach the internet).
    - RAY_enable_metrics_collection=0 (started here): no Prometheus metrics, which nothing here reads and whose
      exporter, without the dashboard agent, logs "Failed to establish connection to the metrics exporter agent".
    - RAY_COLOR_PREFIX=0 when stdout is not a terminal: no colour codes around "(actor[tp0 pp0 dp0] pid=N)" in
      log files (CI, Slurm, `| tee`).
    Rank output and rank errors with their tracebacks are untouched (log_to_driver stays on).
    """
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if start_local:
        env["RAY_enable_metrics_collection"] = "0"
    if not stdout_is_terminal:
        env["RAY_COLOR_PREFIX"] = "0"
    return env


# Ray's warning on every local start, "Token authentication is enabled for this Ray cluster. Set
# RAY_AUTH_MODE=disabled to opt out ...": token auth is Ray's default and stays on; only the note is dropped, by
# that module's logger level while ray.init runs. (Setting RAY_AUTH_MODE=token instead would also silence it, but a
# `ray` imported before the variable is set keeps its cached "disabled" mode and then cannot reach its own GCS.)
_AUTH_NOTE_LOGGER = "ray._private.authentication.authentication_token_setup"


@contextlib.contextmanager
def _quiet_auth_note(enabled: bool):
    log = logging.getLogger(_AUTH_NOTE_LOGGER)
    previous = log.level
    if enabled:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(previous)


def _ray_logging_level() -> int:
    """Ray's driver logger: WARNING (no "Started a local Ray instance."), INFO with --verbose."""
    from megatron_ppo import console

    return logging.INFO if console.verbose_enabled() else logging.WARNING


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def connect_or_start(address: str | None = None, num_cpus: float | None = None, num_gpus: float | None = None, *,
                     include_dashboard: bool = False, object_store_memory: int | None = None,
                     log_to_driver: bool = True, dedup_logs: bool = False) -> RayCluster:
    """ray.init against ``address`` / ``$RAY_ADDRESS``, else a fresh local cluster with ``num_cpus`` CPUs."""
    _set_log_dedup(dedup_logs)
    address = address or os.environ.get("RAY_ADDRESS") or None
    start_local = not (address and address != "local")
    for key, value in ray_quiet_env(start_local, _stdout_is_terminal()).items():
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        raise RuntimeError("connect_or_start: Ray is already initialised in this process; shut it down first")
    start = time.perf_counter()
    if not start_local:
        if num_cpus is not None or num_gpus is not None:
            logger.warning("connect_or_start: num_cpus/num_gpus=%s/%s ignored: connecting to the existing cluster "
                           "at %s, whose resources are its own", num_cpus, num_gpus, address)
        ctx = ray.init(address=address, log_to_driver=log_to_driver, logging_level=_ray_logging_level())
        return RayCluster(ctx.address_info["gcs_address"], False, None, time.perf_counter() - start)
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        temp_dir = tempfile.mkdtemp(prefix="ray-mppo-")
        children = _child_pids()
        try:
            with _quiet_auth_note(_ray_logging_level() > logging.INFO), _children_tmpdir(temp_dir):
                ctx = ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
                               include_dashboard=include_dashboard, object_store_memory=object_store_memory,
                               log_to_driver=log_to_driver, _temp_dir=temp_dir, logging_level=_ray_logging_level())
            return RayCluster(ctx.address_info["gcs_address"], True, temp_dir, time.perf_counter() - start)
        except Exception as exc:
            _kill_new_children(children)  # the GCS and raylet a failed start leaves behind (ray.init never owned them)
            shutil.rmtree(temp_dir, ignore_errors=True)
            if not is_raylet_start_timeout(exc) or attempt == LOCAL_START_ATTEMPTS:
                raise
            logger.warning("connect_or_start: the local Ray node did not register within Ray's fixed 30 s (a busy "
                           "machine); starting it again (attempt %d of %d)", attempt + 1, LOCAL_START_ATTEMPTS)
        except BaseException:
            _kill_new_children(children)
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _children_tmpdir(temp_dir: str):
    """``TMPDIR`` = ``<temp_dir>/tmp`` for the processes ray.init starts (they copy this process's environment);
    this process keeps its own (``tempfile`` cached it already). torch's compile cache stays shared across runs."""
    private = os.path.join(temp_dir, "tmp")
    os.makedirs(private, exist_ok=True)
    saved = {key: os.environ.get(key) for key in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    if saved["TORCHINDUCTOR_CACHE_DIR"] is None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _torch_cache_dir()
    os.environ["TMPDIR"] = private
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _torch_cache_dir() -> str:
    """Where torch's inductor cache would be without our TMPDIR (torch's default_cache_dir, computed here so as
    not to import torch._inductor)."""
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


# Ray waits a fixed 30 s (ray/_private/node.py, not configurable) for a fresh raylet to register with the GCS; on a
# loaded machine (2 cores, other jobs starting theirs) it can take longer, and ray.init raises. A new start usually
# succeeds: the first attempt's processes are gone and the machine has had its burst.
LOCAL_START_ATTEMPTS = 3


def is_raylet_start_timeout(exc: BaseException) -> bool:
    return "timed out during startup" in str(exc)


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_new_children(before: set[int]) -> None:
    import psutil

    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in new:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(new, timeout=10)


def _set_log_dedup(enabled: bool) -> None:
    """Ray reads RAY_DEDUP_LOGS once, when ``ray`` is imported; if it already is, set the flag it read."""
    os.environ["RAY_DEDUP_LOGS"] = "1" if enabled else "0"
    ray_logging = sys.modules.get("ray._private.ray_logging")
    if ray_logging is not None:
        if hasattr(ray_logging, "RAY_DEDUP_LOGS"):
            ray_logging.RAY_DEDUP_LOGS = enabled
        else:
            logger.warning("connect_or_start: cannot set Ray's log de-duplication in this Ray version")
