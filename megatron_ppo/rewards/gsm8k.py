"""GSM8K rule reward.

mode="strict": verl's rule exactly (verl.utils.reward_score.gsm8k): the last `#### N` within the response's last
    300 characters, commas and "$" removed, compared as a string with the ground truth.
mode="numeric": the number after the last "####" (spaces and "$" allowed), else the last number anywhere in the
    response, compared as an exact number: "1,234" = "1234", "18.0" = "18", "-3" != "3". verl's flexible mode
    compares strings, so it marks "1,234" and "18.0" wrong.
Either mode: `score` when correct, `format_score` when an answer was found but is wrong, 0 when none was found.
format_requires_marker=True gives `format_score` only to a wrong answer marked "#### N": under the numeric rule every
answer with a number counts as found, so it is the way to reward the marker while a right answer in prose still
scores `score` (the strict rule scores that 0, below a wrong "#### N").
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from megatron_ppo.rewards.registry import register_reward

MODES = ("strict", "numeric")
_CLIP_CHARS = 300  # verl looks only at the last 300 characters
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = r"-?\d(?:[\d,]*\d)?(?:\.\d+)?"
_MARKED = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)


def extract_answer(solution_str: str, mode: str = "strict") -> str | None:
    """The answer string the mode reads from a response, or None."""
    if mode == "strict":
        found = _STRICT.findall(solution_str[-_CLIP_CHARS:])
        return found[-1].replace(",", "").replace("$", "") if found else None
    if mode == "numeric":
        found = _MARKED.findall(solution_str) or _ANY.findall(solution_str)
        return found[-1] if found else None
    raise ValueError(f"gsm8k reward: mode={mode!r}; choose one of {MODES}")


def parse_number(text: str) -> Fraction | None:
    """Exact value of a decimal string ("1,234", "$18.00", "-3."); None when it is not a number."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return Fraction(value) if value.is_finite() else None


@register_reward("openai/gsm8k")
def compute_score(solution_str: str, ground_truth: str, extra_info=None, mode: str = "strict",
                  format_score: float = 0.0, score: float = 1.0, format_requires_marker: bool = False) -> float:
    answer = extract_answer(solution_str, mode)
    if answer is None:
        return 0.0
    if mode == "strict":
        correct = answer == ground_truth
    else:
        want, got = parse_number(str(ground_truth)), parse_number(answer)
        correct = got == want if want is not None else answer.strip() == str(ground_truth).strip()
    if correct:
        return float(score)
    marked = _MARKED.search(solution_str) is not None if format_requires_marker else True
    return float(format_score) if marked else 0.0
