"""Run a function on N local ranks (torchrun-style env, gloo on CPU): one-shot, or through a reusable pool.

Importing megatron-core costs seconds per process, so tests and benchmarks keep a ``LocalWorkerPool`` alive and
send it jobs: each job is ``fn(rank, world_size, *args)`` on every rank, and ``fn`` must be a module-level
(picklable) function. Jobs call ``parallel.initialize(...)`` / ``parallel.destroy(destroy_process_group=False)``
themselves; the process group lives as long as the pool. A failed or timed-out job tears the pool down (a rank may
be stuck in a collective), and the next job starts a fresh one.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _exit_with_children(*_):
    """Terminate our own children (dist_checkpointing's Manager) and leave without interpreter finalisers."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)
    os._exit(0)


def _pool_worker(rank, world_size, port, threads, jobs, results, parent_pid):
    import signal

    signal.signal(signal.SIGTERM, _exit_with_children)  # pool.close() must not orphan our children
    _set_env(rank, world_size, port)
    torch.set_num_threads(threads)
    import torch.distributed as dist

    from megatron_ppo.parallel.platform import cpu_platform_needed, enable_cpu_platform

    if cpu_platform_needed():
        enable_cpu_platform()
    import datetime

    dist.init_process_group("gloo" if cpu_platform_needed() else "nccl", init_method="env://",
                            timeout=datetime.timedelta(seconds=float(os.environ.get("MEGATRON_PPO_POOL_TIMEOUT", 120))))
    results.put((rank, "ready", None))
    while True:
        try:
            job = jobs.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the parent died: do not linger (workers are not daemonic)
                break
            continue
        if job is None:
            break
        fn, args = job
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        except BaseException:  # report everything, including assertion failures, with the traceback
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()
    # A normal interpreter exit after importing megatron-core takes seconds (module finalisers); nothing is left
    # to flush but the result queue and our own children.
    results.close()
    results.join_thread()
    _exit_with_children()


class LocalWorkerPool:
    """``world_size`` long-lived spawned ranks that run jobs: ``pool.run(fn, *args) -> [result per rank]``."""

    def __init__(self, world_size: int, threads_per_rank: int = 1, start_timeout: float = 300.0):
        self.world_size = world_size
        self.threads = threads_per_rank
        self.start_timeout = start_timeout
        self._procs = []

    def _start(self):
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        # Not daemonic: megatron's dist_checkpointing starts a multiprocessing Manager inside the ranks.
        self._procs = [ctx.Process(target=_pool_worker, args=(r, self.world_size, port, self.threads,
                                                              self._jobs[r], self._results, os.getpid()))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(self.start_timeout, expect="ready")

    def _collect(self, timeout: float, expect: str = "ok"):
        out, errors = {}, {}
        for _ in range(self.world_size):
            try:
                rank, status, payload = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"LocalWorkerPool: ranks {sorted(set(range(self.world_size)) - set(out) - set(errors))}"
                                   f" gave no answer within {timeout:.0f} s; pool closed") from None
            if status == "error":
                errors[rank] = payload
                # The other ranks may be blocked in a collective with the failed one: stop waiting for them.
                break
            out[rank] = payload
        if errors:
            self.close()
            details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RuntimeError(f"LocalWorkerPool: job failed\n{details}")
        return [out[r] for r in range(self.world_size)]

    def run(self, fn, *args, timeout: float = 600.0):
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._jobs:
            q.put((fn, args))
        return self._collect(timeout)

    def close(self):
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._procs:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        self.close()


def run_local(fn, world_size: int, *args, timeout: float = 600.0):
    """One-shot: spawn ``world_size`` ranks, run ``fn(rank, world_size, *args)`` on each, return their results."""
    with LocalWorkerPool(world_size) as pool:
        return pool.run(fn, *args, timeout=timeout)
