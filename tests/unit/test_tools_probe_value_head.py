"""tools/probe_value_head.py: the spread of a fresh normal(0, 0.02) value head's values over hidden states."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from probe_value_head import value_spread  # noqa: E402


def test_value_spread_scales_with_the_hidden_norm():
    hidden = torch.randn(4000, 256, generator=torch.Generator().manual_seed(1))  # norms ~16
    got = value_spread(hidden, heads=64)
    assert got["tokens"] == 4000 and got["hidden_norm_mean"] == pytest.approx(16.0, rel=0.02)
    assert got["value_std"] == pytest.approx(0.02 * 16.0, rel=0.1)
    assert got["value_rms"] == pytest.approx(got["value_rms_expected"], rel=0.1)
    doubled = value_spread(2 * hidden, heads=64)
    assert doubled["value_std"] == pytest.approx(2 * got["value_std"])


def test_a_shared_hidden_state_gives_an_offset_not_a_spread():
    hidden = torch.full((50, 32), 3.0)
    got = value_spread(hidden, heads=8)
    assert got["value_std"] == pytest.approx(0.0, abs=1e-12)
    assert got["value_rms"] > 0.1  # 0.02 * |h| = 0.02 * 3 * sqrt(32) ~ 0.34 per head, offset only
