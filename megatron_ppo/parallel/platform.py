"""The CPU platform layer: the few shims that let megatron-core 0.16.1 run on a CUDA-less torch (gloo).

Megatron-core assumes CUDA in a handful of places that are not about compute: buffer placement through
``torch.cuda.current_device()``, literals like ``device="cuda"``, ``.cuda()``, ``torch.cuda.synchronize()``,
streams/events, the CUDA RNG tracker, and type checks such as ``param.grad.type() == 'torch.cuda.FloatTensor'``.
``enable_cpu_platform()`` installs, only when ``torch.cuda.is_available()`` is False:

1. ``torch.cuda`` stand-ins: ``current_device()`` -> ``torch.device("cpu")``; ``set_device``/``synchronize`` no-ops;
   streams and events that do nothing (events measure wall time); ``torch.cuda`` RNG calls act on the CPU generator.
2. A CPU RNG tracker for megatron's ``tensor_parallel.random`` (the tracker forks ``torch`` CPU generator states,
   so dropout inside ``get_cuda_rng_tracker().fork()`` and full activation recompute are reproducible).
3. A ``TorchFunctionMode`` that remaps ``device="cuda"``/``cuda:N``/``N`` to the CPU, makes ``Tensor.cuda()`` the
   identity, drops ``pin_memory=True`` and answers ``Tensor.type()`` with the ``torch.cuda.*`` name megatron asserts.

Nothing here changes numerics. On a machine with CUDA this module does nothing. The torch-function mode is
thread-local in torch, so it is (re-)entered for the calling thread on every call; call ``enable_cpu_platform()``
in the thread that runs the model (``parallel.initialize`` does it for you; ``build_gpt_model`` only checks).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_lock = threading.Lock()
_cuda_patched = False
_original_cuda_attrs: dict[str, object] = {}
_original_megatron_attrs: dict[str, object] = {}


def cpu_platform_needed() -> bool:
    """True when torch has no usable CUDA device, i.e. the shims are needed."""
    return not torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device-argument convention.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Remaps CUDA placement requests to the CPU; every other call passes through untouched."""

    _TYPE_TO_CUDA = {
        "torch.FloatTensor": "torch.cuda.FloatTensor",
        "torch.HalfTensor": "torch.cuda.HalfTensor",
        "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
        "torch.DoubleTensor": "torch.cuda.DoubleTensor",
        "torch.LongTensor": "torch.cuda.LongTensor",
        "torch.IntTensor": "torch.cuda.IntTensor",
        "torch.ByteTensor": "torch.cuda.ByteTensor",
        "torch.BoolTensor": "torch.cuda.BoolTensor",
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return self._TYPE_TO_CUDA.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


_thread_modes = threading.local()


class _CpuStream:
    """A stream that is always idle: CPU kernels run synchronously."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        return None

    def query(self):
        return True


class _CpuEvent:
    """A completed-immediately event; ``elapsed_time`` reports wall-clock milliseconds like CUDA events."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def elapsed_time(self, end_event):
        return (end_event._t - self._t) * 1000.0


def _cpu_cuda_attrs() -> dict[str, object]:
    return {
        "current_device": lambda: _CPU,
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "current_stream": lambda *a, **k: _CpuStream(),
        "default_stream": lambda *a, **k: _CpuStream(),
        "Stream": _CpuStream,
        "Event": _CpuEvent,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        # torch.manual_seed itself calls torch.cuda.manual_seed_all: act on the CPU generator directly.
        "get_rng_state": lambda *a, **k: torch.default_generator.get_state(),
        "set_rng_state": lambda state, *a, **k: torch.default_generator.set_state(state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)) and None,
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)) and None,
        "empty_cache": lambda: None,
    }


def _patch_torch_cuda() -> None:
    import torch.cuda.random as cuda_random

    for name, value in _cpu_cuda_attrs().items():
        _original_cuda_attrs[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, value)
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        _original_cuda_attrs["random." + name] = getattr(cuda_random, name)
        setattr(cuda_random, name, getattr(torch.cuda, name))


def _make_cpu_rng_tracker_class(base):
    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker over the CPU generator (same API: add / fork / get_states / set_states)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if getattr(mrandom.CudaRNGStatesTracker, "_megatron_ppo_cpu", False):
        return
    tracker_cls = _make_cpu_rng_tracker_class(mrandom.CudaRNGStatesTracker)
    tracker_cls._megatron_ppo_cpu = True
    replacements = {
        "CudaRNGStatesTracker": tracker_cls,
        "_get_cuda_rng_state": lambda *a, **k: torch.get_rng_state(),
        "_set_cuda_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
    }
    for name, value in replacements.items():
        _original_megatron_attrs[name] = getattr(mrandom, name)
        setattr(mrandom, name, value)
    # A tracker created before the patch would still fork CUDA states: drop it.
    mrandom.initialize_rng_tracker(force_reset=True)


def _enter_mode_for_this_thread() -> None:
    mode = getattr(_thread_modes, "mode", None)
    if mode is not None and mode in _get_current_function_mode_stack():
        return
    mode = _CudaToCpuMode()
    mode.__enter__()
    _thread_modes.mode = mode


def enable_cpu_platform() -> bool:
    """Install the CPU shims (idempotent). Returns True if they are active, False on a CUDA machine."""
    global _cuda_patched
    if not cpu_platform_needed():
        return False
    with _lock:
        if not _cuda_patched:
            _patch_torch_cuda()
            _patch_megatron_rng()
            _cuda_patched = True
            logger.info("megatron_ppo: CPU platform shims enabled (no CUDA device)")
    _enter_mode_for_this_thread()
    return True


def disable_cpu_platform() -> None:
    """Undo enable_cpu_platform() (for test hygiene): leave the device remap in this thread, restore torch.cuda
    and megatron's RNG functions. Models built under the shims keep working only while they are enabled."""
    global _cuda_patched
    mode = getattr(_thread_modes, "mode", None)
    stack = _get_current_function_mode_stack()
    if mode is not None and stack and stack[-1] is mode:
        mode.__exit__(None, None, None)
    elif mode is not None and mode in stack:
        raise RuntimeError("disable_cpu_platform: another torch function mode was entered after the CPU remap")
    _thread_modes.mode = None
    with _lock:
        if not _cuda_patched:
            return
        import torch.cuda.random as cuda_random
        from megatron.core.tensor_parallel import random as mrandom

        for name, value in _original_cuda_attrs.items():
            if name.startswith("random."):
                setattr(cuda_random, name[len("random."):], value)
            else:
                setattr(torch.cuda, name, value)
        for name, value in _original_megatron_attrs.items():
            setattr(mrandom, name, value)
        _original_cuda_attrs.clear()
        _original_megatron_attrs.clear()
        mrandom.initialize_rng_tracker(force_reset=True)
        _cuda_patched = False


def cpu_platform_enabled() -> bool:
    """True when the shims are installed and the device remap is active in this thread."""
    mode = getattr(_thread_modes, "mode", None)
    return _cuda_patched and mode is not None and mode in _get_current_function_mode_stack()


def default_device() -> torch.device:
    """The device models and buffers live on: the current CUDA device, or the CPU under the platform layer."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU
