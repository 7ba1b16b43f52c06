"""GSM8K raw jsonl -> verl-schema rows (the same rows verl's examples/data_preprocess/gsm8k.py produces)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from megatron_ppo.errors import UsageError

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The reference extraction (GSM8K's README and verl): the number after the last "#### ", commas removed.
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
SPLITS = ("train", "test")


def default_gsm8k_dir() -> Path:
    """The raw GSM8K folder: $MEGATRON_PPO_GSM8K_DIR, else ../shared/data/gsm8k beside the repository."""
    env = os.environ.get("MEGATRON_PPO_GSM8K_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"


class MalformedLineError(UsageError):
    """A GSM8K jsonl line is not a {"question": str, "answer": str ending in "#### N"} object."""


def final_answer(answer: str) -> str | None:
    """Ground truth of a GSM8K worked answer: the last `#### N`, commas removed; None if there is none."""
    found = _FINAL_ANSWER.findall(answer)
    return found[-1].replace(",", "") if found else None


def to_row(question: str, answer: str, split: str, index: int) -> dict:
    """One verl-schema row. `index` is the 0-based line number in the split's file."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_jsonl(path: str | Path, split: str) -> list[dict]:
    """All rows of one split file; any malformed line is an error naming the file and its 1-based line number."""
    path = Path(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not line.strip():
                raise MalformedLineError(f"{where}: empty line (every line must be one JSON object)")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise MalformedLineError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise MalformedLineError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for key in ("question", "answer"):
                if not isinstance(record.get(key), str):
                    raise MalformedLineError(f"{where}: key {key!r} missing or not a string")
            if final_answer(record["answer"]) is None:
                raise MalformedLineError(f"{where}: answer has no final '#### N' line")
            rows.append(to_row(record["question"], record["answer"], split, index=lineno - 1))
    return rows
