"""The one interface the driver talks to, and its in-process implementation.

A worker group hosts one role's worker (an arbitrary class: ``MegatronWorker``, an ActorWorker, ...) on every rank
of a ``RankLayout`` and offers three calls:

* ``call_all(method, *args, **kwargs)`` -> one result per rank (global rank order);
* ``call_dp(method, shards, *args, **kwargs)`` -> one result per DP replica: every rank of replica d gets
  ``shards[d]`` as the first argument (TP/PP peers must see the same data), and the answer comes from the
  replica's representative rank (tp=0, last pipeline stage);
* ``call_split(method, batch, lengths, ..., balance=True)``: ``call_dp`` over a token-balanced split of the batch's
  rows (contiguous blocks with ``balance=False``): the one DP split, for updates (one global answer per replica);
* ``call_rows(...)``: ``call_split`` with the per-row results put back in the original row order (forwards);

and ``shutdown()``. ``LocalWorkerGroup`` runs one rank in this process (debugging, the in-process driver);
``RayWorkerGroup`` runs TP x PP x DP Ray actors. Any failure surfaces as ``WorkerGroupError``.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Sequence

from megatron_ppo.distributed.dispatch import restore_rows, select_rows, split_rows
from megatron_ppo.distributed.layout import RankLayout
from megatron_ppo.parallel.transfer import to_host

__all__ = ["WorkerGroup", "WorkerGroupError", "LocalWorkerGroup", "resolve_worker_class"]


class WorkerGroupError(RuntimeError):
    """A rank failed or died; the group is gone (a gloo group is unusable after any error)."""


class NodeLostError(WorkerGroupError):
    """The failure's root cause is a node that no longer answers (ray_group.RayWorkerGroup.lost_nodes): not the
    run's fault, so `megatron-ppo train` exits EXIT_NODE_LOST and a Slurm job requeues itself (ray_on_slurm.sh)."""


EXIT_NODE_LOST = 75  # EX_TEMPFAIL (sysexits.h): try again, on other nodes


def resolve_worker_class(worker_cls):
    """A class, or its import path as "package.module:Class" (or "package.module.Class")."""
    if isinstance(worker_cls, type):
        return worker_cls
    if not isinstance(worker_cls, str):
        raise TypeError(f"worker class must be a class or an import path string, got {type(worker_cls).__name__}")
    module, sep, name = worker_cls.partition(":")
    if not sep:
        module, _, name = worker_cls.rpartition(".")
    if not module or not name:
        raise ValueError(f"worker class path {worker_cls!r}: expected 'package.module:Class'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker class path {worker_cls!r}: {e}") from e


class WorkerGroup(ABC):
    role: str
    layout: RankLayout
    dispatch_s: float = 0.0  # seconds spent moving calls and results, not in the workers (0 in this process)
    threads: Sequence[int] = ()  # torch threads of each rank, as the ranks reported them at start-up
    worker_cls: type  # the class every rank hosts (its class-level declarations serve the driver)

    @abstractmethod
    def call_all(self, method: str, *args, **kwargs) -> list:
        """``method(*args, **kwargs)`` on every rank's worker; results in global rank order."""

    @abstractmethod
    def call_dp(self, method: str, shards: Sequence[Any], *args, **kwargs) -> list:
        """``method(shards[d], *args, **kwargs)`` on every rank of DP replica d; the representatives' results."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank (idempotent)."""

    def call_split(self, method: str, batch: Any, lengths: Sequence[int], *args, balance: bool = True,
                   **kwargs) -> tuple[list, list[list[int]]]:
        """The one DP split: ``batch``'s rows over the replicas by token count (``balance=False``: contiguous
        blocks), ``method(rows_of_batch, ...)`` on each; returns (the replicas' results, their rows)."""
        shards = split_rows(list(lengths), self.layout.dp, balance)
        return self.call_dp(method, [select_rows(batch, rows) for rows in shards], *args, **kwargs), shards

    def call_rows(self, method: str, batch: Any, lengths: Sequence[int], *args, balance: bool = True,
                  **kwargs) -> Any:
        """``call_split``, with the per-row results (tensor / list / dict of those) put back in the original row
        order."""
        return restore_rows(*self.call_split(method, batch, lengths, *args, balance=balance, **kwargs))

    def submit_rows(self, method: str, batch: Any, lengths: Sequence[int], *args, balance: bool = True,
                    **kwargs) -> list[list[int]]:
        """``call_split`` of a method that starts work and answers nothing yet (the actor's ``generate_submit``);
        returns each replica's rows, for ``collect_rows``."""
        _, shards = self.call_split(method, batch, lengths, *args, balance=balance, **kwargs)
        return shards

    def collect_rows(self, method: str, shards: Sequence[Sequence[int]], *args, **kwargs) -> Any:
        """``method(*args, **kwargs)`` on every rank; the replicas' answers (their representatives') put back in the
        original row order of the ``submit_rows`` call that returned ``shards``."""
        results = self.call_all(method, *args, **kwargs)
        return restore_rows([results[r] for r in self.layout.representatives], shards)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class LocalWorkerGroup(WorkerGroup):
    """One rank in this process (TP = PP = DP = 1).

    If Megatron's parallel state is not initialised the group initialises it (and destroys it on shutdown);
    otherwise it uses the caller's (which must be a world of one).
    """

    def __init__(self, role: str, worker_cls, worker_kwargs: dict | None = None, *, seed: int = 1234):
        import torch

        from megatron_ppo import parallel

        self.role = role
        self.layout = RankLayout(1, 1, 1)
        self.threads = [torch.get_num_threads()]
        self.worker = None  # before anything can fail: shutdown() below reads it
        self._owns_parallel = not parallel.is_initialized()
        if self._owns_parallel:
            parallel.initialize(tp=1, pp=1, seed=seed)
        elif (parallel.tp_size(), parallel.pp_size(), parallel.dp_size()) != (1, 1, 1):
            raise ValueError(f"LocalWorkerGroup({role}): the process's parallel state is TP={parallel.tp_size()} "
                             f"PP={parallel.pp_size()} DP={parallel.dp_size()}; a local group is one rank")
        try:
            self.worker_cls = resolve_worker_class(worker_cls)
            self.worker = self.worker_cls(**(worker_kwargs or {}))
        except BaseException as e:
            self.shutdown()
            raise WorkerGroupError(f"{role} rank 0 (tp0 pp0 dp0) on this process: building the worker failed: "
                                   f"{type(e).__name__}: {e}") from e

    def _call(self, method: str, *args, **kwargs):
        if self.worker is None:
            raise WorkerGroupError(f"{self.role}: the local group is shut down")
        from megatron_ppo.profiling import phase_range

        try:
            with phase_range(f"{self.role}/{method}"):
                return to_host(getattr(self.worker, method)(*args, **kwargs))  # the driver's tensors live on the CPU
        except Exception as e:
            raise WorkerGroupError(f"{self.role} rank 0 (tp0 pp0 dp0) on this process failed in {method!r}: "
                                   f"{type(e).__name__}: {e}") from e

    def call_all(self, method: str, *args, **kwargs) -> list:
        return [self._call(method, *args, **kwargs)]

    def call_dp(self, method: str, shards: Sequence[Any], *args, **kwargs) -> list:
        if len(shards) != 1:
            raise ValueError(f"{self.role}: {len(shards)} shards for a group with DP=1")
        return [self._call(method, shards[0], *args, **kwargs)]

    def shutdown(self) -> None:
        from megatron_ppo import parallel

        close = getattr(self.worker, "close", None)  # a worker holding processes of its own (a vLLM engine)
        self.worker = None
        if close is not None:
            close()
        if self._owns_parallel and parallel.is_initialized():
            parallel.destroy()
        self._owns_parallel = False
