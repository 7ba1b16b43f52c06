"""tools/bench_async_learning.py's verdict (issue 28: one_step "reaches the synchronous run's reward within noise"):
the difference of the mean last-5 rewards against two standard errors of that difference, by hand."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_async_learning import within_noise  # noqa: E402


def test_within_noise_is_the_difference_against_two_standard_errors():
    sync, one = [0.26, 0.33, 0.25], [0.25, 0.25, 0.24]
    diff, band, ok = within_noise(sync, one)
    var = lambda xs: sum((x - sum(xs) / 3) ** 2 for x in xs) / 2  # noqa: E731  (sample variance)
    assert diff == pytest.approx(sum(one) / 3 - sum(sync) / 3)
    assert band == pytest.approx(2 * math.sqrt(var(sync) / 3 + var(one) / 3))
    assert ok
    diff, band, ok = within_noise([0.30, 0.31, 0.29], [0.10, 0.11, 0.09])  # far apart, little spread
    assert diff == pytest.approx(-0.2) and not ok
