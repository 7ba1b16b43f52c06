"""What `megatron-ppo eval` reports, from scored responses: accuracy with a 95% interval, format rate, mean response
length and mean reward, per data_source and overall. Pure functions (no torch, no models)."""
from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion: unlike the normal approximation it stays inside [0, 1]
    and is not empty at 0 or n successes (what a small eval set of a weak model gives)."""
    if n <= 0:
        return (math.nan, math.nan)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends (no rounding past p)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return (low, high)


def summarise(rows: Sequence[dict]) -> dict:
    """rows: one dict per response with ``data_source``, ``score`` (the sequence reward, as training sees it),
    ``correct`` (bool, or None where the reward has no notion of it: a reward model), ``formatted`` (an answer
    was found; None where the data_source has no answer format we know), ``strict_formatted`` (the answer is marked
    "#### <number>", GSM8K's own format, whatever reward.method reads; None likewise) and ``response_length``.

    Returns {"overall": {...}, "by_data_source": {source: {...}}}; each part has n, mean_score, accuracy,
    accuracy_ci95 [low, high], format_rate and strict_format_rate (None where unknown) and mean_response_length."""
    def part(chosen: list[dict]) -> dict:
        n = len(chosen)
        judged = [r["correct"] for r in chosen if r["correct"] is not None]
        formatted = [r["formatted"] for r in chosen if r["formatted"] is not None]
        strict = [r["strict_formatted"] for r in chosen if r.get("strict_formatted") is not None]
        correct = sum(bool(c) for c in judged)
        out = {"n": n,
               "mean_score": sum(r["score"] for r in chosen) / n if n else math.nan,
               "accuracy": correct / len(judged) if judged else None,
               "accuracy_ci95": list(wilson_interval(correct, len(judged))) if judged else None,
               "format_rate": sum(bool(f) for f in formatted) / len(formatted) if formatted else None,
               "strict_format_rate": sum(bool(f) for f in strict) / len(strict) if strict else None,
               "mean_response_length": sum(r["response_length"] for r in chosen) / n if n else math.nan}
        return out

    sources = sorted({r["data_source"] for r in rows})
    return {"overall": part(list(rows)),
            "by_data_source": {s: part([r for r in rows if r["data_source"] == s]) for s in sources}}


def format_table(summary: dict) -> str:
    """The console table: one line per data_source, then the overall line."""
    head = (f"{'data_source':<24}{'n':>6}{'accuracy':>10}{'95% interval':>18}{'format':>8}{'####':>7}{'length':>8}"
            f"{'score':>8}")
    lines = [head, "-" * len(head)]
    entries = list(summary["by_data_source"].items())
    if len(entries) != 1:
        entries.append(("overall", summary["overall"]))
    for name, p in entries:
        acc = "-" if p["accuracy"] is None else f"{p['accuracy']:.3f}"
        ci = "-" if p["accuracy_ci95"] is None else f"[{p['accuracy_ci95'][0]:.3f}, {p['accuracy_ci95'][1]:.3f}]"
        fmt = "-" if p["format_rate"] is None else f"{p['format_rate']:.3f}"
        strict = "-" if p.get("strict_format_rate") is None else f"{p['strict_format_rate']:.3f}"
        lines.append(f"{name:<24}{p['n']:>6}{acc:>10}{ci:>18}{fmt:>8}{strict:>7}{p['mean_response_length']:>8.1f}"
                     f"{p['mean_score']:>8.3f}")
    return "\n".join(lines)
