"""megatron-ppo eval's summary (evaluation/metrics.py): the Wilson interval against published values, and the
per-data_source accounting (unknown correctness and formats are left out of their rates, not counted as 0)."""
import math

import pytest

from megatron_ppo.evaluation.metrics import format_table, summarise, wilson_interval


@pytest.mark.parametrize("k, n, low, high", [
    # Wilson 95% intervals as tabulated by Newcombe (1998), "Two-sided confidence intervals for the single
    # proportion", Table I (method 3): 81/263, 15/148, 0/20, 1/29
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
])
def test_wilson_interval_matches_newcombe(k, n, low, high):
    got = wilson_interval(k, n)
    assert got[0] == pytest.approx(low, abs=1e-4) and got[1] == pytest.approx(high, abs=1e-4)


def test_wilson_interval_edges():
    assert wilson_interval(0, 5)[0] == 0.0 and wilson_interval(5, 5)[1] == 1.0
    assert all(math.isnan(v) for v in wilson_interval(0, 0))
    lo, hi = wilson_interval(30, 100)
    assert lo < 0.3 < hi and hi - lo < wilson_interval(3, 10)[1] - wilson_interval(3, 10)[0]


def _row(source, score, correct, formatted, length=10):
    return {"data_source": source, "score": score, "correct": correct, "formatted": formatted,
            "strict_formatted": None if formatted is None else bool(formatted and correct), "response_length": length}


def test_summarise_per_source_and_overall():
    rows = [_row("a", 1.0, True, True, 4), _row("a", 0.1, False, True, 6), _row("a", 0.0, False, False, 8),
            _row("b", 0.7, None, None, 2)]
    s = summarise(rows)
    a, b, overall = s["by_data_source"]["a"], s["by_data_source"]["b"], s["overall"]
    assert a["n"] == 3 and a["accuracy"] == pytest.approx(1 / 3) and a["format_rate"] == pytest.approx(2 / 3)
    assert a["strict_format_rate"] == pytest.approx(1 / 3) and b["strict_format_rate"] is None
    assert a["mean_response_length"] == pytest.approx(6.0) and a["mean_score"] == pytest.approx(1.1 / 3)
    assert b["accuracy"] is None and b["format_rate"] is None and b["accuracy_ci95"] is None  # a reward model's
    assert overall["n"] == 4 and overall["accuracy"] == pytest.approx(1 / 3)  # judged rows only
    assert overall["mean_score"] == pytest.approx(1.8 / 4)
    table = format_table(s)
    assert "overall" in table and "0.333" in table and table.count("\n") == 4
