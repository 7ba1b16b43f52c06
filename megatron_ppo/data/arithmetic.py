"""A generated GSM8K-format task a tiny random model can learn in minutes: "What is 3 + 4?" -> `#### 7`.

The default config (`make train`) trains on it: a 2-layer model cannot learn GSM8K arithmetic in a few CPU minutes,
so the reward would stay flat and prove nothing. The rows have GSM8K's schema, instruction and data_source
("openai/gsm8k"), so the same rule reward (rewards/gsm8k.py) scores them; only the questions are simpler (single
digits, sums below 10). Deterministic in `seed`; train and test questions are drawn from the same distribution.
"""
from __future__ import annotations

import random

from megatron_ppo.data.gsm8k import DATA_SOURCE, INSTRUCTION

SPLITS = ("train", "test")
DEFAULT_ROWS = {"train": 2048, "test": 64}


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def rows(split: str, n: int, seed: int) -> list[dict]:
    """n verl-schema rows; the answer a + b is a single digit (0..9)."""
    rng = random.Random(f"{seed}-{split}")  # str seeds are stable across Python runs (sha512)
    out = []
    for index in range(n):
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        q, answer = question(a, b), str(a + b)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": q + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "answer": f"{a} + {b} = {answer}\n#### {answer}",
                           "question": q},
        })
    return out
