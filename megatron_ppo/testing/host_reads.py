"""Count host reads: the calls after which the host holds a device value, so a GPU must finish all queued work first.

On a CPU every such call is free, which is why they creep in unseen; on a GPU each one drains the stream and leaves
the host idle for the launch latency. ``HostReadCounter`` is a ``TorchFunctionMode``: it sees the Python-level calls
(``item``, ``tolist``, ``bool(t)``, ``int(t)``, ``torch.equal``, boolean-mask indexing, ...) in this thread, where
a profiler sees only the aten ops some of them become (``tolist`` and ``.cpu()`` of a CPU tensor record none).

    with HostReadCounter() as reads:
        loss = forward_backward(micro_batch)
    reads.total, reads.by_name      # -> 0, {}

``paused()`` suspends counting for a region that is allowed to read (generation has its own budget);
``HostReadCounter(start_paused=True)`` counts only inside ``resumed()`` regions (a worker's device-side calls).
Reads made by ``torch.optim`` are not counted: a non-capturable torch optimizer keeps its step counters on the CPU
by design, so its ``item`` calls never wait for a device.
"""
from __future__ import annotations

import contextlib
import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode

# A Tensor method or torch function whose result is a host value computed from the tensor's data.
READ_NAMES = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "equal",
                        "allclose", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                        "numpy", "cpu"})
INDEX_NAMES = frozenset({"__getitem__", "__setitem__"})  # a read only when indexed by a boolean mask


def _has_bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def call_name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


class HostReadCounter(TorchFunctionMode):
    """Counts host reads by name in this thread; ``where=True`` also keeps the innermost repo frame of each call."""

    def __init__(self, where: bool = False, start_paused: bool = False):
        super().__init__()
        self.by_name: dict[str, int] = {}
        self.sites: dict[str, int] = {}
        self._where = where
        self._paused = int(start_paused)
        self._depth = 0  # a read nested in another (tolist -> item) counts once

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def resumed(self):
        saved, self._paused = self._paused, 0
        try:
            yield
        finally:
            self._paused = saved

    def _is_read(self, name: str, args) -> bool:
        if name in READ_NAMES:
            return True
        return name in INDEX_NAMES and len(args) > 1 and _has_bool_mask(args[1])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = call_name(func)
        counted = not self._paused and self._depth == 0 and self._is_read(name, args) and not _in_torch_optim()
        if counted:
            self.by_name[name] = self.by_name.get(name, 0) + 1
            if self._where:
                site = _site()
                self.sites[site] = self.sites.get(site, 0) + 1
            self._depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            if counted:
                self._depth -= 1


def _in_torch_optim() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "/torch/optim/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _site() -> str:
    """The innermost frame outside torch and this module: where the read was written."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if "/torch/" in path or path.endswith("host_reads.py"):
            continue
        return f"{path.split('site-packages/')[-1].split('/work/main/')[-1]}:{frame.lineno}"
    return "?"


class WorkerCalls:
    """Counts, per role, the host reads inside every ``MegatronWorker.forward`` / ``train_step`` (the device-side
    calls: micro-batches on the model's device, losses, metrics, the optimizer step), the micro-batches they ran and,
    on CUDA, each role's peak allocated memory within its calls. Patches the class while active; generation and the
    driver's bookkeeping on CPU tensors are outside. ``counting`` False: memory only."""

    def __init__(self, counting: bool = True, where: bool = False):
        self.counter = HostReadCounter(where=where, start_paused=True)
        self.counting = counting
        self.reads: dict[str, int] = {}
        self.micro_batches: dict[str, int] = {}
        self.peak_bytes: dict[str, int] = {}
        self.transient_bytes: dict[str, int] = {}  # peak in a call minus what was allocated when it began
        self._saved = None

    def totals(self) -> dict:
        reads, micro = sum(self.reads.values()), sum(self.micro_batches.values())
        return {"reads": reads, "micro_batches": micro, "reads_per_micro_batch": reads / micro if micro else None,
                "by_role": {r: {"reads": self.reads.get(r, 0), "micro_batches": n} for r, n in
                            self.micro_batches.items()},
                "peak_gib_by_role": {r: b / 2**30 for r, b in self.peak_bytes.items()},
                "transient_gib_by_role": {r: b / 2**30 for r, b in self.transient_bytes.items()}}

    def reset(self) -> None:
        self.reads.clear()
        self.micro_batches.clear()
        self.peak_bytes.clear()
        self.transient_bytes.clear()
        self.counter.by_name.clear()
        self.counter.sites.clear()

    def _wrap(self, method):
        calls = self

        def run(worker, micro_batches, *args, **kwargs):
            cuda = torch.cuda.is_available() and getattr(worker, "device", None) is not None and \
                worker.device.type == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats(worker.device)
                allocated = torch.cuda.memory_allocated(worker.device)
            before = calls.counter.total
            try:
                if calls.counting:
                    with calls.counter.resumed():
                        return method(worker, micro_batches, *args, **kwargs)
                return method(worker, micro_batches, *args, **kwargs)
            finally:
                role = worker.role
                calls.reads[role] = calls.reads.get(role, 0) + calls.counter.total - before
                calls.micro_batches[role] = calls.micro_batches.get(role, 0) + len(micro_batches)
                if cuda:
                    peak = torch.cuda.max_memory_allocated(worker.device)
                    calls.peak_bytes[role] = max(calls.peak_bytes.get(role, 0), peak)
                    calls.transient_bytes[role] = max(calls.transient_bytes.get(role, 0), peak - allocated)
        return run

    def __enter__(self):
        from megatron_ppo.workers.megatron_worker import MegatronWorker

        self._saved = MegatronWorker.forward, MegatronWorker.train_step
        MegatronWorker.forward, MegatronWorker.train_step = self._wrap(self._saved[0]), self._wrap(self._saved[1])
        self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        from megatron_ppo.workers.megatron_worker import MegatronWorker

        self.counter.__exit__(*exc)
        MegatronWorker.forward, MegatronWorker.train_step = self._saved
        return False
