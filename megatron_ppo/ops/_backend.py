"""Which implementation serves an op: the compiled kernels for the tensor's device, or the torch reference.

``MEGATRON_PPO_OPS`` (read at every call, so tests and debug sessions can flip it):
  ``auto`` (default)  kernels when the extension for the device is importable, else the torch reference, with a
                      WARNING naming the import error (a GPU run on the reference loops GAE over T in Python);
  ``reference``       always the torch reference (debugging, bisecting a numerical difference);
  ``kernels``         kernels or a RuntimeError (CI/GPU checks that must not silently test the fallback).
``set_mode()`` overrides the environment from code (e.g. from a config key).
"""
from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger("megatron_ppo.ops")

ENV_VAR = "MEGATRON_PPO_OPS"
MODES = ("auto", "reference", "kernels")
_EXTENSIONS = {"cpu": "megatron_ppo._kernels_cpu", "cuda": "megatron_ppo._kernels_cuda"}

_mode_override: str | None = None
_modules: dict[str, ModuleType | None] = {}
_load_errors: dict[str, str] = {}
_logged: set[tuple[str, str]] = set()


def mode() -> str:
    """The active selection mode: the set_mode() override, else $MEGATRON_PPO_OPS, else 'auto'."""
    value = _mode_override if _mode_override is not None else os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {list(MODES)}, got {value!r}")
    return value


def set_mode(value: str | None) -> str | None:
    """Override $MEGATRON_PPO_OPS from code ('auto' | 'reference' | 'kernels'; None = back to the environment).
    Returns the previous override."""
    global _mode_override
    if value is not None and value not in MODES:
        raise ValueError(f"ops mode must be one of {list(MODES)} or None, got {value!r}")
    previous, _mode_override = _mode_override, value
    return previous


def extension(device_type: str) -> ModuleType | None:
    """The compiled extension for 'cpu' or 'cuda', or None when it was not built (import attempted once)."""
    if device_type not in _modules:
        name = _EXTENSIONS.get(device_type)
        module = None
        if name is None:
            _load_errors[device_type] = f"no kernels for device type {device_type!r}"
        else:
            try:
                module = importlib.import_module(name)
            except ImportError as exc:  # not built (CPU-only wheel, no nvcc, MEGATRON_PPO_BUILD_CUDA=0, ...)
                _load_errors[device_type] = f"{name} not importable: {exc}"
        _modules[device_type] = module
    return _modules[device_type]


def kernels_for(device: torch.device, op: str) -> ModuleType | None:
    """The extension that should run ``op`` on ``device`` under the current mode (None = torch reference)."""
    selected = mode()
    module = None if selected == "reference" else extension(device.type)
    if module is None and selected == "kernels":
        reason = _load_errors.get(device.type, "unavailable")
        raise RuntimeError(f"{ENV_VAR}=kernels but no {device.type} kernels for ops.{op}: {reason}")
    _log_once(op, device.type, module)
    return module


def backend(device: torch.device | str | None = None) -> str:
    """'cuda' / 'cpu' (compiled kernels) or 'reference' for ops on ``device`` (default: cuda if available)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = torch.device(device).type
    if mode() == "reference" or extension(device_type) is None:
        return "reference"
    return device_type


def unavailable_reason(device_type: str) -> str | None:
    """Why the extension for ``device_type`` did not load (None if it loaded or was not tried yet)."""
    extension(device_type)
    return _load_errors.get(device_type)


def _log_once(op: str, device_type: str, module: ModuleType | None) -> None:
    key = (op, device_type if module is not None else f"{device_type}-reference")
    if key in _logged:
        return
    _logged.add(key)
    if module is not None:
        logger.info("megatron_ppo.ops.%s: %s kernels (%s)", op, device_type, module.__name__)
    elif mode() == "reference":
        logger.info("megatron_ppo.ops.%s: torch reference on %s (forced by %s)", op, device_type, ENV_VAR)
    else:  # the kernels for this device did not load: a silent fallback would be a slow run nobody asked for
        logger.warning("megatron_ppo.ops.%s: torch reference on %s, the compiled kernels did not load (%s); "
                       "%s=kernels makes this an error", op, device_type, _load_errors.get(device_type, ""), ENV_VAR)
