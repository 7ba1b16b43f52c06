"""The value checks cost no more than the math they guard: a mask shared by one step's calls is read once (and
re-read after an in-place write), the 0/1 check is one compare, agg_loss checks finiteness through its own sum.
Counted in aten ops (deterministic), not in time; the timings are tools/bench_algo_checks.py's."""
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ppo.algo import checks
from megatron_ppo.algo import losses as L


class CountPasses(TorchDispatchMode):
    """Names of the aten ops that read or write a tensor of ``numel`` elements (full passes over the data)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [a for a in (*args, *(kwargs or {}).values(), out) if isinstance(a, torch.Tensor)]
        if name not in ("detach", "alias") and any(t.numel() == self.numel for t in tensors):
            self.ops.append(name)
        return out


def passes(fn, numel: int) -> list[str]:
    with CountPasses(numel) as counter:
        fn()
    return counter.ops


def test_float_mask_check_is_one_compare_and_one_reduction_then_cached():
    x, m = torch.randn(4, 6), (torch.rand(4, 6) > 0.3).float()
    first = passes(lambda: checks.mask(m, "mask", "x", x), m.numel())
    assert sorted(first) == ["any", "ne", "ne"]  # valid = m != 0; (m != valid).any()  (was: ne, ne, and, any, ne)
    again = passes(lambda: checks.mask(m, "mask", "x", x), m.numel())
    assert again == ["ne"]  # the bool mask the caller needs; the 0/1 values are not re-read
    torch.testing.assert_close(checks.mask(m, "mask", "x", x), m != 0)


def test_cached_mask_is_rechecked_after_an_in_place_write_and_not_kept_alive():
    x, m = torch.randn(3, 5), torch.ones(3, 5)
    checks.mask(m, "mask", "x", x)
    m[1, 2] = 2.0  # bumps the version counter
    with pytest.raises(ValueError, match="mask must contain only 0 and 1 \\(got other values such as 2.0\\)"):
        checks.mask(m, "mask", "x", x)
    view = m[0]
    checks.mask(torch.ones(5), "row", "x", x[0])
    m[1, 2] = 1.0
    checks.mask(m, "mask", "x", x)
    view[0] = float("nan")  # a write through a view bumps the shared counter
    with pytest.raises(ValueError, match="got other values such as nan"):
        checks.mask(m, "mask", "x", x)
    probe = torch.ones(3, 5)
    checks.mask(probe, "mask", "x", x)
    ref = checks._VALIDATED_MASKS[-1][0]
    del probe
    gc.collect()
    assert ref() is None


def test_inference_mode_masks_are_checked_every_time():
    with torch.inference_mode():
        x, m = torch.randn(2, 3), torch.ones(2, 3)
        assert checks.mask(m, "mask", "x", x).all()
        bad = m.clone()
        bad[0, 0] = 0.5
        with pytest.raises(ValueError, match="0.5"):
            checks.mask(bad, "mask", "x", x)


def test_finite_with_mask_is_three_passes():
    x, valid = torch.randn(8, 8), torch.rand(8, 8) > 0.5
    assert passes(lambda: checks.finite(x, "x", valid), x.numel()) == ["where", "mul_", "sum"]  # was 7 (isfinite: 4)
    assert passes(lambda: checks.finite(x, "x"), x.numel()) == ["mul", "sum"]
    x[~valid] = float("nan")  # ignored
    checks.finite(x, "x", valid)
    x[valid.nonzero()[0].unbind()] = float("inf")
    with pytest.raises(ValueError, match="x has 1 NaN/inf values at valid \\(mask=1\\) positions"):
        checks.finite(x, "x", valid)


def test_agg_loss_checks_finiteness_through_its_own_sum():
    loss, mask = torch.randn(6, 10), (torch.rand(6, 10) > 0.2)
    mask[:, 0] = True
    math = passes(lambda: L._agg_loss(loss, mask, "token-mean", 1, None, None, None), loss.numel())
    assert passes(lambda: L.agg_loss(loss, mask, "token-mean"), loss.numel()) == math  # no pass of its own
    bad = loss.clone()
    bad[2, 0] = float("nan")
    bad[~mask] = float("inf")  # masked: ignored
    for mode in L.AGG_LOSS_MODES:
        with pytest.raises(ValueError, match="loss_mat has 1 NaN/inf values at valid"):
            L.agg_loss(bad, mask.float(), mode)
        L.agg_loss(torch.where(mask, loss, float("inf")), mask, mode)


def test_agg_loss_overflowing_sum_of_finite_values_is_not_an_error():
    loss = torch.full((2, 4), 3e38)  # finite float32; their sum overflows to inf
    out = L.agg_loss(loss, torch.ones(2, 4), "token-sum")
    assert torch.isinf(out)
