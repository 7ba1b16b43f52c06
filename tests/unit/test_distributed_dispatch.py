"""Token-balanced DP split and order restoration (pure): balance on real GSM8K lengths, equal row counts,
round trips for tensors, lists and dicts, and errors that name the replica."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from megatron_ppo.data.gsm8k import default_gsm8k_dir
from megatron_ppo.distributed.dispatch import restore_rows, select_rows, split_rows, token_imbalance


def _gsm8k_lengths(n: int) -> list[int]:
    """Prompt + answer lengths of the first n GSM8K train rows in word/punctuation pieces (a BPE-like count)."""
    path = default_gsm8k_dir() / "train.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K not found at {path} (set MEGATRON_PPO_GSM8K_DIR)")
    lengths = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            lengths.append(len(re.findall(r"\w+|[^\w\s]", row["question"] + " " + row["answer"])))
            if len(lengths) == n:
                return lengths
    raise AssertionError(f"{path} has fewer than {n} rows")


def test_gsm8k_dp4_imbalance_at_most_5_percent():
    lengths = _gsm8k_lengths(256)
    assert max(lengths) > 2 * min(lengths)  # real spread, not a trivial input
    shards = split_rows(lengths, 4)
    assert [len(s) for s in shards] == [64] * 4
    assert sorted(i for s in shards for i in s) == list(range(256))
    balanced = token_imbalance(lengths, shards)
    contiguous = token_imbalance(lengths, [list(range(d * 64, (d + 1) * 64)) for d in range(4)])
    print(f"DP4 token imbalance on 256 GSM8K rows: karmarkar-karp {balanced:.4%}, contiguous {contiguous:.4%}")
    assert balanced <= 0.05
    assert balanced < contiguous


@pytest.mark.parametrize("n,dp", [(10, 4), (7, 2), (5, 5), (9, 1), (1001, 8)])
def test_uneven_row_counts_differ_by_at_most_one(n, dp):
    rng = random.Random(n)
    lengths = [rng.randint(0, 400) for _ in range(n)]
    shards = split_rows(lengths, dp)
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert all(s == sorted(s) for s in shards)


def test_too_few_rows_and_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="3 rows cannot feed 4 DP replicas"):
        split_rows([5, 6, 7], 4)
    with pytest.raises(ValueError, match="row 1 has length -2"):
        split_rows([5, -2], 1)


def test_restore_rows_round_trip_tensor_list_dict():
    rng = random.Random(0)
    lengths = [rng.randint(1, 50) for _ in range(11)]
    shards = split_rows(lengths, 3)
    assert any(s != list(range(s[0], s[0] + len(s))) for s in shards)  # a real permutation, not contiguous blocks
    batch = {"ids": torch.arange(11 * 2).view(11, 2), "text": [f"row{i}" for i in range(11)]}
    per_replica = [select_rows(batch, rows) for rows in shards]
    # what a replica computes per row: keep the row id so the order check cannot pass by accident
    results = [{"score": r["ids"][:, 0].float() * 10, "echo": list(r["text"])} for r in per_replica]
    out = restore_rows(results, shards)
    assert torch.equal(out["score"], torch.arange(0, 22, 2).float() * 10)
    assert out["echo"] == batch["text"]


def test_restore_rows_names_the_replica_that_lost_rows():
    shards = [[0, 2], [1]]
    with pytest.raises(ValueError, match="DP replica 1 has 2 rows, it was given 1"):
        restore_rows([torch.zeros(2), torch.zeros(2)], shards)
    with pytest.raises(ValueError, match="DP replica 1 has keys"):
        restore_rows([{"a": [1, 2]}, {"b": [3]}], shards)


@pytest.mark.parametrize("n, dp, want", [(8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]), (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
                                         (3, 3, [[0], [1], [2]]), (5, 1, [[0, 1, 2, 3, 4]])])
def test_unbalanced_split_is_contiguous_blocks_in_row_order(n, dp, want):
    """balance=False (trainer.balance_batch=false): blocks of rows in order, tokens ignored, counts within one."""
    lengths = [100 if i % 2 else 1 for i in range(n)]
    assert split_rows(lengths, dp, balance=False) == want
    with pytest.raises(ValueError, match="cannot feed"):
        split_rows([1] * (dp - 1), dp, balance=False) if dp > 1 else split_rows([], 2, balance=False)
