"""Where a step's time goes: named ranges for every phase (one naming scheme, always on) and a profiler per process
for the steps ``global_profiler`` chooses (docs/trainer.md, "Profiling").

Ranges are ``torch.profiler.record_function`` (seen in torch traces) and, on a GPU, NVTX (seen by Nsight Systems):
``ppo/<phase>`` on the driver (gen, reward, old_log_prob, adv, update_critic, update_actor, sync_weights, save,
...), ``<role>/<method>`` around every worker call in a rank, ``<role>/forward`` per micro-batch,
``<role>/forward_backward`` around a mini-batch's schedule (megatron's schedule runs the backward passes) and
``<role>/optimizer_step``. Outside a profiled step they cost a few microseconds each (docs/bench/profiling.md).

``StepProfiler`` runs in the driver and in each chosen rank: ``start(step)`` before the step's first phase,
``stop(step)`` after its last. ``torch``: a chrome trace (``<save_path>/step<N>/<tag>.pt.trace.json``, open it in
Perfetto or chrome://tracing) and the key-averages table beside it; ``torch_memory``: a CUDA allocator snapshot
(``<tag>.memory.pickle``, for pytorch.org/memory_viz); ``nsys``: ``cudaProfilerStart`` / ``cudaProfilerStop``, so
``nsys profile --capture-range=cudaProfilerApi`` records exactly these steps. ``CAPTURE_EVENTS`` (and the file
``$MEGATRON_PPO_PROFILE_EVENTS`` names, from every process) records every capture start and stop: what a test
reads; the product never reads it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from torch.profiler import record_function

CAPTURE_EVENTS: list[tuple[str, str, int]] = []  # (start | stop, tag, step), in order
EVENTS_ENV = "MEGATRON_PPO_PROFILE_EVENTS"  # a test hook: a file every process appends its capture events to


def _capture_event(kind: str, tag: str, step: int) -> None:
    CAPTURE_EVENTS.append((kind, tag, step))
    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{kind} {tag} {step}\n")


@contextlib.contextmanager
def phase_range(name: str) -> Iterator[None]:
    """A named range in torch traces and, on a GPU, in Nsight Systems' NVTX rows."""
    nvtx = torch.cuda.is_available()
    with record_function(name):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


def profiled_ranks(cfg) -> list[int]:
    """The role-local ranks global_profiler profiles (null: rank 0 of each role)."""
    ranks = cfg.global_profiler.ranks
    return [0] if ranks is None else list(ranks)


def save_root(cfg) -> str:
    """global_profiler.save_path, else <trainer.log_dir>/profile."""
    g, t = cfg.global_profiler, cfg.trainer
    return t.expand(g.save_path) if g.save_path else os.path.join(t.expand(t.log_dir), "profile")


NSYS_TRACE = "cuda,nvtx,osrt,cublas,cudnn"


def nsight_runtime_envs(cfg, role: str, world_size: int, on_gpu: bool) -> dict[int, dict]:
    """tool=nsys on Ray: each profiled rank's Ray ``runtime_env`` runs its process under Nsight Systems (Ray's
    ``nsight`` plugin, as verl's worker_nsight_options), recording only inside the capture ranges the rank opens
    at the chosen steps, into ``<save_path>/<role>_rank<r>.nsys-rep``. Empty off a GPU (no nsys to run)."""
    g = cfg.global_profiler
    if g.tool != "nsys" or not on_gpu:
        return {}
    root = save_root(cfg)
    return {rank: {"nsight": {"t": NSYS_TRACE, "capture-range": "cudaProfilerApi", "capture-range-end": "repeat",
                              "o": os.path.join(root, f"{role}_rank{rank}")}}
            for rank in profiled_ranks(cfg) if rank < world_size}


class StepProfiler:
    """One process's profiler for global_profiler's steps; ``tag`` names its files (``driver``,
    ``actor_rank0``, ...)."""

    def __init__(self, tool: str | None, steps, root: str, tag: str):
        self.tool, self.steps, self.root, self.tag = tool, set(steps or ()), root, tag
        self.active: int | None = None
        self.profile = None

    def wants(self, step: int) -> bool:
        return self.tool is not None and step in self.steps

    def start(self, step: int) -> None:
        if not self.wants(step) or self.active is not None:
            return
        self.active = step
        if self.tool == "torch":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profile.start()
        elif self.tool == "torch_memory":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        elif self.tool == "nsys":
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            _capture_event("start", self.tag, step)

    def stop(self, step: int) -> list[str]:
        """End the step's profile; returns the files written."""
        if self.active != step:
            return []
        self.active = None
        if self.tool == "nsys":
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            _capture_event("stop", self.tag, step)
            return []  # nsys writes its own report
        directory = os.path.join(self.root, f"step{step}")
        os.makedirs(directory, exist_ok=True)
        base = os.path.join(directory, self.tag)
        if self.tool == "torch":
            self.profile.stop()
            trace, table = base + ".pt.trace.json", base + ".key_averages.txt"
            self.profile.export_chrome_trace(trace)
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"  # phases first
            with open(table, "w") as f:
                f.write(self.profile.key_averages().table(sort_by=sort, row_limit=60))
            self.profile = None
            return [trace, table]
        if self.tool == "torch_memory":
            path = base + ".memory.pickle"
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            return [path]
        return []
