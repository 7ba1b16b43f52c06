"""Cheap input checks shared by the algo modules.

Two kinds of check:
- metadata checks (type, shape, dtype): free, always on;
- value checks (NaN/inf at valid positions, 0/1 masks): one reduction per tensor and, on a GPU, one host sync
  when the result is read. A mask found to be 0/1 is remembered (by identity and version counter) and not
  re-read by later calls in the same step; ``finite_via`` checks finiteness through a sum the math already made. They are on by default; set ``MEGATRON_PPO_ALGO_VALUE_CHECKS=0`` (or call
  ``set_value_checks(False)``) to turn them off in a run that has already been validated.
  Inside ``deferred()`` (a worker's forward / backward over its micro-batches) a value check leaves its verdict on
  the device and all verdicts are read at once when the block ends: one host read per call instead of one per
  check per micro-batch. A failure raises the same error, at the block's end, before anything is applied.

Every failure is a ``ValueError`` whose message starts with the argument's name.
"""
from __future__ import annotations

import contextlib
import math
import operator
import os
import threading
import weakref
from collections.abc import Sequence

import torch

_VALUE_CHECKS = os.environ.get("MEGATRON_PPO_ALGO_VALUE_CHECKS", "1") != "0"


def set_value_checks(enabled: bool) -> bool:
    """Turn the data-dependent checks on or off; returns the previous setting."""
    global _VALUE_CHECKS
    previous, _VALUE_CHECKS = _VALUE_CHECKS, bool(enabled)
    return previous


def value_checks_enabled() -> bool:
    return _VALUE_CHECKS


_PENDING = threading.local()  # .checks: [(bad flag: 0-dim bool device tensor, raise_error: callable)] or absent


@contextlib.contextmanager
def deferred():
    """Queue the value checks made inside and read their verdicts once, at exit (see the module docstring).
    Nested blocks join the outermost. An exception inside skips the reading (it is already failing)."""
    outer = getattr(_PENDING, "checks", None)
    if outer is not None:
        yield
        return
    _PENDING.checks = pending = []
    try:
        yield
    finally:
        _PENDING.checks = None
    if pending:
        verdicts = torch.stack([flag.reshape(()).to(torch.bool) for flag, _ in pending]).tolist()  # one host read
        for bad, (_, raise_error) in zip(verdicts, pending):
            if bad:
                raise_error()


def _verdict(bad: torch.Tensor, raise_error) -> None:
    """Raise now if ``bad`` (a 0-dim bool tensor) holds, or queue it inside ``deferred()``."""
    pending = getattr(_PENDING, "checks", None)
    if pending is not None:
        pending.append((bad, raise_error))
    elif bool(bad):
        raise_error()


def float_tensor(x, name: str, ndim: int | None = None, min_ndim: int | None = None) -> torch.Tensor:
    """A floating-point tensor, optionally of a given rank."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(x.shape)}")
    return x


def same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def float_like(x, name: str, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """A floating tensor with exactly ``ref``'s shape."""
    float_tensor(x, name)
    same_shape(name, x, ref_name, ref)
    return x


def mask(m, name: str, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask (bool, integer or floating dtype) shaped like ``ref``; returned as bool.

    Float/int masks holding anything but 0 and 1 (weights, NaN, attention masks with 2s) are rejected:
    masks select tokens here, weighting is what ``rollout_is_weights`` is for. (The compiled GAE kernel makes
    the same check inside its own pass: ``mask_metadata`` + ``raise_not_01``.)
    """
    mask_metadata(m, name, ref_name, ref)
    if m.dtype == torch.bool:
        return m
    valid = m != 0
    if _VALUE_CHECKS and not _seen_01(m):
        # one compare against the bool mask (promoted on the fly): 0 -> False, 1 -> True, anything else (NaN too)
        # differs. Three passes in all with ``valid``, which the caller needs anyway (it used to be five).
        _verdict((m != valid).any(), lambda: raise_not_01(m, name))
        _remember_01(m)  # (deferred: a wrong mask fails at the block's end all the same)
    return valid


def mask_metadata(m, name: str, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """The free half of ``mask``: a tensor of bool, integer or floating dtype shaped like ``ref`` (values unread)."""
    if not isinstance(m, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(m).__name__}")
    if m.dtype != torch.bool and (m.is_complex() or not (m.is_floating_point() or _is_integer(m.dtype))):
        raise ValueError(f"{name} must be a bool, integer or floating 0/1 mask, got dtype {m.dtype}")
    same_shape(name, m, ref_name, ref)
    return m


def raise_not_01(m: torch.Tensor, name: str):
    """The error for a mask known to hold a value other than 0 and 1 (finds one to name; error path only)."""
    raise ValueError(f"{name} must contain only 0 and 1 (got other values such as {_first_bad(m)})")


def finite(x: torch.Tensor, name: str, valid: torch.Tensor | None = None) -> None:
    """No NaN/inf in ``x`` where ``valid`` (bool) is True (everywhere when ``valid`` is None)."""
    if not _VALUE_CHECKS:
        return
    x = x.detach()
    # x * 0 is 0 where x is finite and NaN where it is not, so its sum is NaN iff an element (a valid one) is NaN/inf:
    # two passes (three with a mask) and no overflow possible. torch.isfinite is four passes (abs, ne, eq, mul);
    # it only runs on the error path, for the count in the message.
    zeros = x * 0 if valid is None else torch.where(valid, x, 0).mul_(0)
    _verdict(torch.isnan(zeros.sum()), lambda: _raise_nonfinite(x, name, valid))


def _raise_nonfinite(x: torch.Tensor, name: str, valid: torch.Tensor | None) -> None:
    bad = ~torch.isfinite(x)
    if valid is not None:
        bad &= valid
    where = "at valid (mask=1) positions" if valid is not None else ""
    raise ValueError(f"{name} has {int(bad.sum())} NaN/inf values {where}".rstrip())


def finite_via(result: torch.Tensor, x: torch.Tensor, name: str, valid: torch.Tensor | None = None) -> None:
    """``finite(x, name, valid)`` for free when ``result`` sums every checked element of ``x``: a finite sum proves
    them all finite (NaN and inf propagate through sums), so the exact check runs only when ``result`` is not
    finite (bad input, or an overflowing sum: then the exact check passes and the inf result stands)."""
    if not _VALUE_CHECKS:
        return
    x = x.detach()

    def exact_check():  # the sum overflowed or the input is bad: the exact check decides (error path only)
        zeros = x * 0 if valid is None else torch.where(valid, x, 0).mul_(0)
        if bool(torch.isnan(zeros.sum())):
            _raise_nonfinite(x, name, valid)

    _verdict(~torch.isfinite(result.detach()).all(), exact_check)


def nonnegative(x: torch.Tensor, name: str, valid: torch.Tensor | None = None) -> None:
    if not _VALUE_CHECKS:
        return
    bad = x.detach() < 0
    if valid is not None:
        bad &= valid
    _verdict(bad.any(), lambda: _raise(f"{name} has {int(bad.sum())} negative values"))


def index_range(x: torch.Tensor, name: str, low: int, high: int) -> None:
    """Every element of the integer tensor ``x`` lies in [low, high) (always checked: an index out of range is not
    a value a run may skip checking)."""
    if x.numel():
        _verdict((x.min() < low) | (x.max() >= high), lambda: _raise(
            f"{name} must lie in [{low}, {high}), got [{int(x.min())}, {int(x.max())}]"))


def _raise(message: str) -> None:
    raise ValueError(message)


def real_number(value, name: str, *, low: float | None = None, high: float | None = None,
                low_inclusive: bool = True, high_inclusive: bool = True, allow_inf: bool = False) -> float:
    """A Python/numpy/0-dim-tensor real number inside the given bounds, returned as float."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got bool {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(v) or (math.isinf(v) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {v}")
    if low is not None and (v < low or (v == low and not low_inclusive)):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low}, got {v}")
    if high is not None and (v > high or (v == high and not high_inclusive)):
        raise ValueError(f"{name} must be {'<=' if high_inclusive else '<'} {high}, got {v}")
    return v


def integer(value, name: str, *, low: int | None = None) -> int:
    """A Python/numpy integer or a one-element integer tensor, at least ``low``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    v = operator.index(value)
    if low is not None and v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")
    return v


def choice(value, name: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


# Masks already found to be 0/1, so that a mask shared by several calls of one step (policy loss, entropy and KL
# aggregation, metrics) is validated once per batch, not per call. Keyed on the tensor object (weak reference:
# nothing is kept alive) and its version counter, which every in-place write bumps (views share it).
_VALIDATED_MASKS: list[tuple[weakref.ref, int]] = []
_VALIDATED_MAX = 8


def _version(m: torch.Tensor) -> int | None:
    """The tensor's version counter; None for inference-mode tensors, which have none (never cached)."""
    try:
        return m._version
    except RuntimeError:
        return None


def _seen_01(m: torch.Tensor) -> bool:
    version = _version(m)
    return version is not None and any(ref() is m and v == version for ref, v in _VALIDATED_MASKS)


def _remember_01(m: torch.Tensor) -> None:
    version = _version(m)
    if version is None:
        return
    _VALIDATED_MASKS[:] = [(r, v) for r, v in _VALIDATED_MASKS if r() is not None and r() is not m]
    _VALIDATED_MASKS.append((weakref.ref(m), version))
    del _VALIDATED_MASKS[:-_VALIDATED_MAX]


def _is_integer(dtype: torch.dtype) -> bool:
    return dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _first_bad(m: torch.Tensor):
    bad = m[(m != 0) & (m != 1)]
    return bad.flatten()[0].item()
