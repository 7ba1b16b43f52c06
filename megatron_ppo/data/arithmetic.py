"""A generated GSM8K-format task a tiny random model can learn in minutes: "What is 3 + 4?" -> `#### 7`.

The default config (`make train`) trains on it: a 2-layer model cannot learn GSM8K arithmetic in a few CPU minutes,
so the reward would stay flat and prove nothing. The rows have GSM8K's schema, instruction and data_source
("openai/gsm8k"), so the same rule reward (rewards/gsm8k.py) scores them; only the questions are simpler (single
digits, sums below 10). Deterministic in `seed`; train and test questions are drawn from the same distribution.

level="multi" is the task for a real pretrained model (SmolLM2-135M-Instruct, the learning benchmark): 2-3 digit
addition, subtraction and multiplication (the mix in LEVELS), hard enough that the base model is often wrong. Its
test questions are held out: no test question appears in train.
"""
from __future__ import annotations

import random

from megatron_ppo.data.gsm8k import DATA_SOURCE, INSTRUCTION

SPLITS = ("train", "test")
DEFAULT_ROWS = {"train": 2048, "test": 64}
LEVELS = ("single", "multi")
HELD_OUT_TEST_ROWS = 512  # level multi: the first this-many test questions never appear in train
MULTI_OPS = (("+", 10, 999, 10, 999), ("-", 10, 999, 10, 999), ("*", 10, 99, 2, 19))  # op, a range, b range


def question(a: int, b: int, op: str = "+") -> str:
    return f"What is {a} {op} {b}?"


def _multi(rng) -> tuple[int, str, int, int]:
    op, a_lo, a_hi, b_lo, b_hi = MULTI_OPS[rng.randrange(len(MULTI_OPS))]
    a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
    if op == "-" and b > a:
        a, b = b, a  # non-negative differences
    return a, op, b, {"+": a + b, "-": a - b, "*": a * b}[op]


def rows(split: str, n: int, seed: int, level: str = "single") -> list[dict]:
    """n verl-schema rows. single: the answer a + b is a single digit (0..9); multi: see the module doc (train
    rows never repeat a question of the test split of the same seed)."""
    if level not in LEVELS:
        raise ValueError(f"arithmetic: level={level!r}; choose one of {LEVELS}")
    rng = random.Random(f"{seed}-{split}" if level == "single" else f"{seed}-{split}-{level}")
    held_out = set()
    if level == "multi" and split != "test":
        held_out = {r["extra_info"]["question"] for r in rows("test", HELD_OUT_TEST_ROWS, seed, level)}
    out = []
    while len(out) < n:
        if level == "single":
            a = rng.randint(0, 9)
            b = rng.randint(0, 9 - a)
            op, value = "+", a + b
        else:
            a, op, b, value = _multi(rng)
        q, answer = question(a, b, op), str(value)
        if q in held_out:
            continue
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": q + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": len(out), "answer": f"{a} {op} {b} = {answer}\n#### {answer}",
                           "question": q},
        })
    return out
