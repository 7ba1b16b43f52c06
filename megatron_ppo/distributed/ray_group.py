"""TP x PP x DP ranks of one role as Ray actors, initialised together, failing fast as one.

Start-up: one ``RankActor`` per rank on its placement-group bundle (rank r -> ``placement.bundle_indices[r]``),
rank 0's node IP and a free port on that node become MASTER_ADDR/PORT, then every rank initialises
torch.distributed + Megatron's parallel state and builds the worker concurrently (one wait over all set-up
futures: ranks that rendezvous one after another time out in the TCP store). The worker class (a class, or its
import path) is built INSIDE the actor after parallel init, so no Megatron state crosses a process boundary. Each
rank checks that parallel_state gives it the (tp, pp, dp) coordinates ``RankLayout`` promised.

Fail fast: every call is submitted to all ranks and awaited with ``ray.wait(num_returns=1)``. A dead peer breaks
its gloo peers' collectives at once and Ray reports the death itself promptly; a live peer missing from a
collective would block the others until the group timeout: ``collective_timeout_s`` on gloo (the backstop), the
longer ``nccl_timeout_s`` on NCCL (parallel.group_timeout_s: a synchronous checkpoint save keeps NCCL peers
waiting for minutes, and NCCL's watchdog aborts a rank at its timeout). So on the first error the group waits
``grace_s`` for the other ranks' errors (to name the root cause: a death before the gloo errors it caused), kills
every rank (a gloo group is unusable after any error), makes sure the processes and their children are gone, and
raises ``WorkerGroupError`` naming role, rank, (tp, pp, dp), node and pid, with the remote traceback.

Colocated GPUs: a rank whose GPU other processes share (``release_device_cache``: the driver decides it from the
placement, trainer/groups.shares_gpu) gives its caching allocator's free blocks back after every call
(``torch.cuda.empty_cache``), so the next role's call can use them; ``info()`` counts the releases and the bytes.

Output: Ray prefixes an actor's stdout/stderr with the actor's repr, here ``actor[tp0 pp0 dp1]``.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import time
from typing import Any, Sequence

from megatron_ppo.distributed.group import NodeLostError, WorkerGroup, WorkerGroupError, resolve_worker_class
from megatron_ppo.distributed.layout import RankCoords, RankLayout
from megatron_ppo.distributed.placement import RolePlacement, rank_span
from megatron_ppo.parallel.transfer import to_host

logger = logging.getLogger(__name__)

__all__ = ["RankActor", "RayWorkerGroup"]


class RankActor:
    """The process of one rank: parallel init, then the role's worker; ``call`` runs a worker method."""

    def __init__(self, role: str, rank: int, coords: tuple[int, int, int]):
        self.role, self.rank, self.coords = role, rank, RankCoords(*coords)
        self.worker = None
        self.release_below = 0.0  # cluster.release_heap_below_available, set by setup
        self.heap_releases = 0
        self.release_device_cache = False  # set by setup: other processes share this rank's GPU
        self.cache_releases = 0
        self.cache_released_bytes = 0

    def __repr__(self) -> str:  # Ray's prefix of this actor's log lines
        return f"{self.role}[{self.coords}]"

    def info(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "resources": ray.get_runtime_context().get_assigned_resources(),
                "placement_group": ray.get_runtime_context().get_placement_group_id(),
                "heap_releases": self.heap_releases, "cache_releases": self.cache_releases,
                "cache_released_bytes": self.cache_released_bytes}

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, layout: tuple[int, int, int], seed: int,
              collective_timeout_s: float, threads: int, worker_cls, worker_kwargs: dict,
              release_heap_below_available: float = 0.0, nccl_timeout_s: float | None = None,
              release_device_cache: bool = False) -> dict:
        import torch

        from megatron_ppo import console

        console.quiet()  # Megatron's config dumps and bucket lists, TE/Apex warnings: off unless --verbose
        if console.verbose_enabled():  # the rank's own INFO lines (heap and cache releases) reach the driver's screen
            import logging

            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        tp, pp, dp = layout
        torch.set_num_threads(threads)  # Ray sets OMP_NUM_THREADS=1 for fractional/1-CPU actors: decide here
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(tp * pp * dp),
                          RANK=str(self.rank), LOCAL_RANK="0")  # Ray gives a GPU actor its own CUDA_VISIBLE_DEVICES
        from megatron_ppo import parallel

        parallel.initialize(tp=tp, pp=pp, seed=seed, timeout_s=collective_timeout_s, nccl_timeout_s=nccl_timeout_s)
        got = RankCoords(parallel.tp_rank(), parallel.pp_rank(), parallel.dp_rank())
        if got != self.coords:
            raise RuntimeError(f"{self!r} rank {self.rank}: megatron parallel_state placed this rank at ({got}), "
                               f"the layout expected ({self.coords})")
        self.worker = resolve_worker_class(worker_cls)(**worker_kwargs)
        self.release_below = release_heap_below_available
        self.release_device_cache = release_device_cache
        return {"threads": torch.get_num_threads(), "group_timeout_s": parallel.process_group_timeout_s()}

    def call(self, _mppo_method: str, _mppo_return: bool, *args, **kwargs) -> tuple[Any, float]:
        """The method's result (None where the driver does not keep it) and the seconds the method itself took:
        the driver's wall time of the call minus this is the dispatch cost (serialisation, RPC, gather)."""
        from megatron_ppo.profiling import phase_range

        start = time.perf_counter()
        with phase_range(f"{self.role}/{_mppo_method}"):
            result = getattr(self.worker, _mppo_method)(*args, **kwargs)
            result = to_host(result) if _mppo_return else None  # never a GPU tensor
        self._release_heap_if_host_short(_mppo_method)
        self._release_device_cache(_mppo_method)
        return result, time.perf_counter() - start

    def _release_device_cache(self, method: str) -> None:
        """After a call, when other processes share this rank's GPU: give the allocator's free blocks back (each role
        process otherwise keeps its own peak, logits or KV cache or activations, while the others run)."""
        if not self.release_device_cache:
            return
        from megatron_ppo.parallel.device_memory import release_cached_memory

        freed = release_cached_memory()
        self.cache_releases += 1
        self.cache_released_bytes += freed
        if self.cache_releases == 1:
            logger.info("%r: other processes share this GPU: after each call this rank gives its cached device "
                        "memory back (first: after %s, %.2f GiB)", self, method, freed / 2 ** 30)

    def _release_heap_if_host_short(self, method: str) -> None:
        """After a call, give this rank's free heap back when the host is short of memory (models/heap.py)."""
        from megatron_ppo.models.heap import release_if_memory_short

        seen = release_if_memory_short(self.release_below)
        if seen is None:
            return
        self.heap_releases += 1
        if self.heap_releases == 1 or self.heap_releases % 100 == 0:  # the rank's own log (--verbose shows it)
            logger.info("%r: after %s %.0f %% of the memory was available (the host's, or its cgroup limit's; "
                           "under cluster.release_heap_below_available=%g): this rank gave back its free heap "
                           "(release %d; each costs page faults when the memory is touched again)", self, method,
                           100 * seen, self.release_below, self.heap_releases)


class RayWorkerGroup(WorkerGroup):
    """``layout.world_size`` RankActors of ``role`` on ``placement``, hosting ``worker_cls(**worker_kwargs)``.

    collective_timeout_s: torch.distributed / Megatron group timeout on gloo (the backstop for a live rank that never
        joins a collective). nccl_timeout_s: the group timeout on NCCL (None: collective_timeout_s; see
        parallel.group_timeout_s). call_timeout_s: optional bound on any one call. release_device_cache: every rank
        empties its CUDA cache after each call (other processes share its GPU).
    runtime_envs: {rank: Ray runtime_env} for ranks that need one (global_profiler tool=nsys: profiling.py).
    """

    def __init__(self, role: str, layout: RankLayout, placement: RolePlacement, worker_cls,
                 worker_kwargs: dict | None = None, *, seed: int = 1234, collective_timeout_s: float = 120.0,
                 setup_timeout_s: float = 600.0, call_timeout_s: float | None = None, grace_s: float = 1.0,
                 kill_timeout_s: float = 20.0, release_heap_below_available: float = 0.0,
                 nccl_timeout_s: float | None = None, release_device_cache: bool = False,
                 runtime_envs: dict[int, dict] | None = None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if placement.pg is None:
            raise ValueError(f"{role}: placement has no placement group (create_placement first)")
        if len(placement.bundle_indices) != layout.world_size:
            raise ValueError(f"{role}: {layout} but the placement seats {len(placement.bundle_indices)} ranks")
        for name, value in (("collective_timeout_s", collective_timeout_s), ("nccl_timeout_s", nccl_timeout_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{role}: {name}={value} must be > 0")
        self.worker_cls = resolve_worker_class(worker_cls)  # a typo fails here, before any process starts
        self.role, self.layout, self.placement = role, layout, placement
        self.call_timeout_s, self.grace_s, self.kill_timeout_s = call_timeout_s, grace_s, kill_timeout_s
        self.infos: list[dict | None] = [None] * layout.world_size
        self.rank_table: list[dict] = []  # every role's rank -> node records (placement.rank_table), for node loss
        self.node_ports: dict[str, int] = {}  # node ip -> its Ray node manager's port (the liveness probe)
        self.threads: list[int] = []  # per rank, from setup
        self.group_timeout_s: list[float] = []  # per rank, its process group's timeout as torch reports it
        self.timings: dict[str, float] = {}
        self.dispatch_s = 0.0  # summed over calls: wall time minus the slowest rank's time in the method
        self._dead = False
        start = time.perf_counter()
        remote_cls = ray.remote(RankActor)
        self.actors = [
            remote_cls.options(
                num_cpus=placement.num_cpus, num_gpus=placement.num_gpus, max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement.pg, placement_group_bundle_index=placement.bundle_indices[rank]),
                **({"runtime_env": runtime_envs[rank]} if rank in (runtime_envs or {}) else {}),
            ).remote(role, rank, tuple(layout.coords(rank)))
            for rank in range(layout.world_size)]
        try:
            self.infos = self._wait([a.info.remote() for a in self.actors], "start", setup_timeout_s)
            self.node_ports = {n["NodeManagerAddress"]: n["NodeManagerPort"] for n in ray.nodes() if n.get("Alive")}
            self.timings["spawn_s"] = time.perf_counter() - start
            master_addr = self.infos[0]["node_ip"]
            master_port = self._wait([self.actors[0].free_port.remote()], "free_port", setup_timeout_s,
                                     ranks=[0])[0]
            kwargs_ref = ray.put(dict(worker_kwargs or {}))
            cls_ref = ray.put(worker_cls)
            setup = [a.setup.remote(master_addr, master_port, (layout.tp, layout.pp, layout.dp), seed,
                                    collective_timeout_s, placement.threads, cls_ref, kwargs_ref,
                                    release_heap_below_available, nccl_timeout_s, release_device_cache)
                     for a in self.actors]
            answers = self._wait(setup, "setup", setup_timeout_s)
            self.threads = [info["threads"] for info in answers]
            self.group_timeout_s = [info["group_timeout_s"] for info in answers]
        except BaseException:
            self.shutdown()
            raise
        self.timings["start_s"] = time.perf_counter() - start
        logger.info("%s: %s up in %.1f s; rank pids %s", role, layout, self.timings["start_s"],
                    [info["pid"] for info in self.infos])  # which process is which rank (kill, py-spy)

    # ------------------------------------------------------------------------------------------------ calls

    def call_all(self, method: str, *args, **kwargs) -> list:
        return self._call(method, [args] * self.layout.world_size, kwargs, keep=range(self.layout.world_size),
                          start=time.perf_counter())

    def call_dp(self, method: str, shards: Sequence[Any], *args, **kwargs) -> list:
        import ray

        start = time.perf_counter()
        if len(shards) != self.layout.dp:
            raise ValueError(f"{self.role}: {len(shards)} shards for DP={self.layout.dp}")
        refs = [ray.put(shard) for shard in shards]  # serialised once per replica, not once per TP/PP peer
        per_rank = [(refs[self.layout.coords(r).dp],) + args for r in range(self.layout.world_size)]
        results = self._call(method, per_rank, kwargs, keep=self.layout.representatives, start=start)
        return [results[r] for r in self.layout.representatives]

    def _call(self, method: str, per_rank_args: list[tuple], kwargs: dict, keep, start: float) -> list:
        """Run ``method`` on every rank; ``dispatch_s`` grows by the call's wall time (from ``start``, before the
        arguments were serialised) minus the slowest rank's own time in the method."""
        import ray

        if self._dead:
            raise WorkerGroupError(f"{self.role}: the group is shut down")
        keep = set(keep)
        # Each distinct argument is serialised once (a state dict for every rank is one object, not world_size).
        refs_by_id = {}
        for args in per_rank_args:
            for a in args:
                if id(a) not in refs_by_id:
                    refs_by_id[id(a)] = a if isinstance(a, ray.ObjectRef) else ray.put(a)
        refs = [actor.call.remote(method, rank in keep, *[refs_by_id[id(a)] for a in per_rank_args[rank]], **kwargs)
                for rank, actor in enumerate(self.actors)]
        answers = self._wait(refs, method, self.call_timeout_s)
        self.dispatch_s += max(0.0, time.perf_counter() - start - max(seconds for _, seconds in answers))
        return [result for result, _ in answers]

    # ------------------------------------------------------------------------------------------------ fail fast

    def _wait(self, refs: list, what: str, timeout_s: float | None, ranks: Sequence[int] | None = None) -> list:
        """Results of ``refs`` (one per rank in ``ranks``); on the first error or death: kill all, raise."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                self._fail(what, [], pending.values(), timed_out=timeout_s)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as first:  # RayTaskError (the rank raised) or RayActorError (it died)
                    errors = [(rank, first)]
                    if pending:  # the other ranks' errors, to tell a death from the gloo errors it caused
                        more, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.grace_s)
                        for r in more:
                            try:
                                ray.get(r)
                            except Exception as e:
                                errors.append((pending[r], e))
                            pending.pop(r)
                    self._fail(what, errors, pending.values())
        return [results[r] for r in ranks]

    def _where(self, rank: int) -> str:
        info = self.infos[rank] or {}
        return (f"{self.role} rank {rank} ({self.layout.coords(rank)}) on node {info.get('node_ip', '?')} "
                f"pid {info.get('pid', '?')}")

    def lost_nodes(self, timeout_s: float = 2.0) -> list[str]:
        """One line per node of this group's ranks whose Ray node manager does not accept a TCP connection within
        ``timeout_s`` (a node that died, or whose link went down), naming the ranks it held: every role's, from
        ``rank_table`` when the driver set it, else this role's."""
        from concurrent.futures import ThreadPoolExecutor

        nodes = {}
        for info in self.infos:
            if info and info.get("node_ip") in self.node_ports:
                nodes.setdefault(info["node_ip"], info.get("host", ""))
        if not nodes:
            return []
        with ThreadPoolExecutor(len(nodes)) as pool:
            answers = dict(zip(nodes, pool.map(lambda ip: _probe(ip, self.node_ports[ip], timeout_s), nodes)))
        lines = []
        for ip, problem in answers.items():
            if problem is None:
                continue
            table = self.rank_table or [{"role": self.role, "rank": r, "ip": (i or {}).get("node_ip")}
                                        for r, i in enumerate(self.infos)]
            held: dict[str, list[int]] = {}
            for row in table:
                if row.get("ip") == ip:
                    held.setdefault(row["role"], []).append(row["rank"])
            ranks = "; ".join(f"{role} ranks {rank_span(rs)}" for role, rs in held.items()) or "no ranks known"
            name = f"{nodes[ip]} ({ip})" if nodes[ip] and nodes[ip] != ip else ip
            lines.append(f"node {name} lost: its Ray node manager at {ip}:{self.node_ports[ip]} does not answer "
                         f"({problem}); it held {ranks}")
        return lines

    def _fail(self, what: str, errors: list, silent_ranks, timed_out: float | None = None):
        """Kill the group and raise: deaths first (they cause their peers' gloo errors), then raised errors."""
        from ray.exceptions import RayActorError

        silent = sorted(silent_ranks)
        deaths = [(r, e) for r, e in errors if isinstance(e, RayActorError)]
        raised = [(r, e) for r, e in errors if not isinstance(e, RayActorError)]
        summaries, details = [], []
        for r, e in deaths:
            first = (str(e).strip().splitlines() or [""])[0]
            summaries.append(f"{self._where(r)} died during {what!r} ({type(e).__name__}: {first})")
        for r, e in raised:
            cause = getattr(e, "cause", None) or e
            first = (str(cause).strip().splitlines() or [""])[0]
            summaries.append(f"{self._where(r)} raised {type(cause).__name__}: {first} (in {what!r})")
            details.append(f"--- remote traceback of {self.role} rank {r} ({self.layout.coords(r)}):\n"
                           f"{_indent(_ANSI.sub('', str(e)).strip())}")
        if timed_out is not None:
            summaries.append(f"{self.role}: {what!r} did not finish within {timed_out:.0f} s (call timeout)")
        if silent:
            summaries.append(f"{self.role} ranks {silent} had not answered")
        lost = self.lost_nodes()
        summaries = lost + summaries  # a lost node is the root cause of its peers' errors
        self.shutdown(graceful=False)
        message = "\n".join([summaries[0]] + [f"also: {s}" for s in summaries[1:]] + details + [
            f"all {self.layout.world_size} {self.role} ranks ({self.layout}) were killed (a torch.distributed "
            "group is unusable after an error)"])
        raise (NodeLostError if lost else WorkerGroupError)(message) from (errors[0][1] if errors else None)

    def shutdown(self, graceful: bool = True) -> None:
        """Kill every rank and wait until their processes (and children, on this node) are gone. ``graceful``: a
        healthy group's workers that hold processes of their own (``close``: a vLLM engine) end them first, so
        they can clean up (bounded by grace_s; a failed group's ranks are not asked)."""
        import ray

        if self._dead:
            return
        if graceful and callable(getattr(self.worker_cls, "close", None)):
            refs = [actor.call.remote("close", False) for actor in self.actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(self.grace_s, 10.0))
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:  # the kill below ends it anyway
                    logger.warning("%s: close before shutdown failed: %s", self.role, e)
        self._dead = True
        here = ray.util.get_node_ip_address()
        local_pids = [info["pid"] for info in self.infos if info and info.get("node_ip") == here]
        children = _child_pids(local_pids)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # already dead
                logger.debug("%s: ray.kill: %s", self.role, e)
        _reap(local_pids, children, self.kill_timeout_s, self.role)

    def pids(self) -> list[int | None]:
        return [info["pid"] if info else None for info in self.infos]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its remote tracebacks for terminals


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _probe(ip: str, port: int, timeout_s: float) -> str | None:
    """None if something accepts a TCP connection at ip:port within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return None
    except OSError as e:
        return type(e).__name__ if not e.strerror else e.strerror.lower()


def _child_pids(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            pass
    return out


def _reap(pids: list[int], children: list[int], timeout_s: float, role: str) -> None:
    """Wait for the ranks' processes to exit (SIGKILL after ``timeout_s``), then SIGKILL their orphaned children
    (e.g. a dist_checkpointing Manager): a killed rank cannot stop them and Ray does not own them."""
    import psutil

    def processes(ids):
        out = []
        for pid in ids:
            try:
                out.append(psutil.Process(pid))
            except psutil.Error:
                pass
        return out

    _, alive = psutil.wait_procs(processes(pids), timeout=timeout_s)
    for p in alive:
        logger.warning("%s: pid %d still alive %.0f s after ray.kill: SIGKILL", role, p.pid, timeout_s)
    orphans = processes(children)
    for p in alive + orphans:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive + orphans, timeout=5)
