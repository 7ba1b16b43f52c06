"""Run a function on N local ranks (torchrun-style env, gloo on CPU): one-shot, or through a reusable pool.

Importing megatron-core costs seconds per process, so tests and benchmarks keep a ``LocalWorkerPool`` alive and
send it jobs: each job is ``fn(rank, world_size, *args)`` on every rank, and ``fn`` must be a module-level
(picklable) function. Jobs call ``parallel.initialize(...)`` / ``parallel.destroy(destroy_process_group=False)``
themselves; the process group lives as long as the pool. A failed or timed-out job tears the pool down (a rank may
be stuck in a collective), and the next job starts a fresh one.

A rank that dies (an exception during setup, ``os._exit``, a signal) fails the start or the job within about a
second, not after the timeout: the parent waits on the results queue in short slices and checks every rank's
``exitcode`` in between. The error names the rank, its exit code or signal, and the traceback a rank that failed
during setup sends before exiting. Closing the pool (after any failure) terminates, then kills, every rank and every
process a rank started, so nothing is orphaned. A start whose rank 0 could not listen on the port ``free_port()``
proposed (another process took it while the ranks imported) is retried with a new port, up to 3 starts.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)


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


SETUP_FAILED_EXIT_CODE = 1  # like an uncaught exception
EXIT_GRACE_S = 10.0  # a rank told to stop exits in well under a second (os._exit); then close() kills it
POLL_S = 0.25  # how often the parent checks that every rank is alive while it waits for results
START_ATTEMPTS = 3  # starts tried when the port free_port() proposed is taken before rank 0 listens on it


def _setup_rank(rank, world_size, port, threads):
    """Environment, threads, CPU platform and the process group of one rank."""
    import datetime

    import torch.distributed as dist

    from megatron_ppo.parallel.platform import cpu_platform_needed, enable_cpu_platform

    _set_env(rank, world_size, port)
    torch.set_num_threads(threads)
    if cpu_platform_needed():
        enable_cpu_platform()
    dist.init_process_group("gloo" if cpu_platform_needed() else "nccl", init_method="env://",
                            timeout=datetime.timedelta(seconds=float(os.environ.get("MEGATRON_PPO_POOL_TIMEOUT", 120))))


def _pool_worker(rank, world_size, port, threads, jobs, results, parent_pid):
    signal.signal(signal.SIGTERM, _exit_with_children)  # pool.close() must not orphan our children
    try:
        _setup_rank(rank, world_size, port, threads)
    except BaseException:  # tell the parent why, then leave (non-zero) without waiting for peers we cannot reach
        results.put((rank, "setup_error", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(SETUP_FAILED_EXIT_CODE)
    import torch.distributed as dist

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


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}, exit code {code}"
        except ValueError:
            return f"killed by signal {-code}, exit code {code}"
    return f"exit code {code}"


def _descendants(procs) -> dict:
    """{pid: psutil handle} of every process the live ranks started (e.g. dist_checkpointing's Manager)."""
    import psutil

    out = {}
    for p in procs:
        try:
            out.update((c.pid, c) for c in psutil.Process(p.pid).children(recursive=True))
        except psutil.Error:  # the rank is already gone
            pass
    return out


def _wait_dead(procs: list, timeout: float) -> None:
    """Wait until none of ``procs`` runs (a zombie counts as dead: reaping an orphan is init's business, and
    psutil.wait_procs waits for that too, seconds in some containers)."""
    import psutil

    deadline = time.monotonic() + timeout
    while procs and time.monotonic() < deadline:
        alive = []
        for c in procs:
            try:
                if c.status() != psutil.STATUS_ZOMBIE:
                    alive.append(c)
            except psutil.Error:
                pass
        procs = alive
        time.sleep(0.02)


class RankFailedError(RuntimeError):
    """A rank died or raised; ``port_taken``: one failed because the rendezvous port was in use."""

    def __init__(self, message: str, port_taken: bool = False):
        super().__init__(message)
        self.port_taken = port_taken


class LocalWorkerPool:
    """``world_size`` long-lived spawned ranks that run jobs: ``pool.run(fn, *args) -> [result per rank]``.

    port: the rendezvous port (MASTER_PORT) of the ranks; None picks a free one at every start.
    """

    def __init__(self, world_size: int, threads_per_rank: int = 1, start_timeout: float = 300.0,
                 port: int | None = None):
        self.world_size = world_size
        self.threads = threads_per_rank
        self.start_timeout = start_timeout
        self.port = port
        self._procs = []
        # Processes the ranks started, noted while waiting on them: a rank that dies leaves its children
        # re-parented, and they can no longer be found from it.
        self._children = {}

    def _start(self):
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once()
            except RankFailedError as e:
                # free_port() only proposes a port: in the seconds the ranks spend importing, another process may
                # take it. Retry with a new one then; a port the caller chose is the caller's to fix.
                if self.port is not None or attempt == START_ATTEMPTS or not e.port_taken:
                    raise
                logger.warning("LocalWorkerPool: rendezvous port taken while the ranks started; retrying with "
                               "another (attempt %d of %d)", attempt + 1, START_ATTEMPTS)

    def _start_once(self):
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = self.port or free_port()
        # Not daemonic: megatron's dist_checkpointing starts a multiprocessing Manager inside the ranks.
        self._procs = [ctx.Process(target=_pool_worker, args=(r, self.world_size, port, self.threads,
                                                              self._jobs[r], self._results, os.getpid()))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(self.start_timeout, "while starting")

    def _collect(self, timeout: float, during: str):
        """One answer per rank, or an error as soon as a rank reports one, dies, or the timeout passes."""
        out = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world_size:
            try:
                rank, status, payload = self._results.get(timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                self._children.update(_descendants(self._procs))
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    self._fail(during, dead, {})
                if time.monotonic() >= deadline:
                    self.close()
                    raise TimeoutError(f"LocalWorkerPool: ranks {sorted(set(range(self.world_size)) - set(out))}"
                                       f" gave no answer within {timeout:.0f} s {during}; pool closed") from None
                continue
            if status == "setup_error":  # the rank is exiting: wait for it, for its exit code
                self._procs[rank].join(timeout=10)
                self._fail(during, [rank], {rank: payload})
            if status == "error":
                # The other ranks may be blocked in a collective with the failed one: stop waiting for them.
                self._fail(during, [], {rank: payload})
            out[rank] = payload
        return [out[r] for r in range(self.world_size)]

    def _fail(self, during: str, dead: list, tracebacks: dict):
        """Close the pool and raise RuntimeError naming the dead ranks (pid, exit code or signal) and the ranks
        that reported an exception, with their tracebacks."""
        try:  # a rank that died during setup put its traceback on the queue before exiting
            while True:
                rank, status, payload = self._results.get(timeout=POLL_S)
                if status in ("setup_error", "error"):
                    tracebacks.setdefault(rank, payload)
        except queue.Empty:
            pass
        procs = list(self._procs)
        dead = sorted(set(dead) | {r for r, p in enumerate(procs) if p.exitcode is not None})
        self.close()
        lines = [f"LocalWorkerPool: rank {r} (pid {procs[r].pid}) died {during} ({_exit_text(procs[r].exitcode)})"
                 for r in dead]
        lines += [f"LocalWorkerPool: rank {r} raised {during}" for r in sorted(set(tracebacks) - set(dead))]
        lines.append("pool closed" + ("" if tracebacks else "; no traceback: the rank exited without reporting "
                                                            "one (see its stderr)"))
        lines += [f"--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items())]
        raise RankFailedError("\n".join(lines), port_taken=any("EADDRINUSE" in tb for tb in tracebacks.values()))

    def run(self, fn, *args, timeout: float = 600.0):
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._jobs:
            q.put((fn, args))
        return self._collect(timeout, f"while running {getattr(fn, '__qualname__', fn)}")

    def close(self, grace: float = 1.0):
        """Terminate the ranks (SIGTERM: they end their own children), kill those still alive after ``grace``
        seconds (a rank blocked in a C++ collective or rendezvous never runs its handler), then kill whatever the
        ranks had started (now, or seen while waiting on them) that is still alive."""
        procs, self._procs = self._procs, []
        children, self._children = {**self._children, **_descendants(procs)}, {}
        if not procs:
            return
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        import psutil

        for c in children.values():
            try:
                c.kill()  # psutil checks that the pid was not reused
            except psutil.Error:  # already gone, as it should be
                pass
        _wait_dead(list(children.values()), timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._procs:
            for q in self._jobs:
                q.put(None)
            deadline = time.monotonic() + EXIT_GRACE_S  # one bound for all ranks, not one per rank
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.close()


def run_local(fn, world_size: int, *args, timeout: float = 600.0):
    """One-shot: spawn ``world_size`` ranks, run ``fn(rank, world_size, *args)`` on each, return their results."""
    with LocalWorkerPool(world_size) as pool:
        return pool.run(fn, *args, timeout=timeout)
