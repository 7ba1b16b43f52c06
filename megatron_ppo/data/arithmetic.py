"""A generated GSM8K-format task a tiny random model can learn in minutes: "What is 3 + 4?" -> `#### 7`.

The default config (`make train`) trains on it: a 2-layer model cannot learn GSM8K arithmetic in a few CPU minutes,
so the reward would stay flat and prove nothing. The rows have GSM8K's schema, instruction and data_source
("openai/gsm8k"), so the same rule reward (rewards/gsm8k.py) scores them; only the questions are simpler (single
digits, sums below 10). Deterministic in `seed`; train and test questions are drawn from the same distribution.

level="multi" is the task for a real pretrained model (SmolLM2-135M-Instruct, the learning benchmark): the mix in
MULTI_OPS, chosen so the base model scores 20-60% (measured per kind in docs/data.md; 2-3 digit problems gave it
~10%). Its test questions are held out: a fixed quarter of all possible questions (by a hash of the question text,
the same for every seed) is the test pool, test rows are distinct questions from it, and train never draws from it.
"""
from __future__ import annotations

import random
import zlib

from megatron_ppo.data.gsm8k import DATA_SOURCE, INSTRUCTION

SPLITS = ("train", "test")
DEFAULT_ROWS = {"train": 2048, "test": 64}
LEVELS = ("single", "multi")
# level multi, one kind each draw: (op, a range, b range). SmolLM2-135M-Instruct's greedy accuracy per kind (20
# questions each, docs/data.md): 2-digit sums to 98 30%, 2-digit x 1-digit 20%, 10-30 x 10-19 30%, 1-digit sums
# 15%, 1-digit products 60%, teens minus 1-digit 25%; 3-digit sums and differences and 2-digit minus 1-digit ~0%.
MULTI_OPS = (("+", 10, 49, 10, 49), ("*", 10, 99, 2, 9), ("*", 10, 30, 10, 19), ("+", 2, 9, 2, 9), ("*", 2, 9, 2, 9),
             ("-", 10, 18, 2, 9))
TEST_POOL_MOD = 4  # level multi: a question is in the test pool when crc32(question) % 4 == 0


def question(a: int, b: int, op: str = "+") -> str:
    return f"What is {a} {op} {b}?"


def _value(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _multi(rng) -> tuple[int, str, int, int]:
    op, a_lo, a_hi, b_lo, b_hi = MULTI_OPS[rng.randrange(len(MULTI_OPS))]
    a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
    if op == "-" and b > a:
        a, b = b, a  # non-negative differences
    return a, op, b, _value(a, op, b)


def in_test_pool(q: str) -> bool:
    """Level multi's held-out split: a fixed function of the question, so no seed's train ever sees a test question."""
    return zlib.crc32(q.encode()) % TEST_POOL_MOD == 0


def multi_questions() -> set[str]:
    """Every question level multi can draw."""
    out = set()
    for op, a_lo, a_hi, b_lo, b_hi in MULTI_OPS:
        for a in range(a_lo, a_hi + 1):
            for b in range(b_lo, b_hi + 1):
                out.add(question(*((b, a) if op == "-" and b > a else (a, b)), op))
    return out


def test_pool_size() -> int:
    return sum(in_test_pool(q) for q in multi_questions())


def rows(split: str, n: int, seed: int, level: str = "single") -> list[dict]:
    """n verl-schema rows. single: the answer a + b is a single digit (0..9); multi: see the module doc (test rows
    are distinct questions of the test pool; train rows never come from it)."""
    if level not in LEVELS:
        raise ValueError(f"arithmetic: level={level!r}; choose one of {LEVELS}")
    if level == "multi" and split == "test" and n > test_pool_size():
        raise ValueError(f"arithmetic: level multi's test pool holds {test_pool_size()} distinct questions; "
                         f"{n} test rows asked")
    rng = random.Random(f"{seed}-{split}" if level == "single" else f"{seed}-{split}-{level}")
    seen, out = set(), []
    while len(out) < n:
        if level == "single":
            a = rng.randint(0, 9)
            b = rng.randint(0, 9 - a)
            op, value = "+", a + b
        else:
            a, op, b, value = _multi(rng)
        q, answer = question(a, b, op), str(value)
        if level == "multi" and (in_test_pool(q) != (split == "test") or (split == "test" and q in seen)):
            continue
        seen.add(q)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": q + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": len(out), "answer": f"{a} {op} {b} = {answer}\n#### {answer}",
                           "question": q},
        })
    return out
