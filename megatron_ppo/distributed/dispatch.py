"""Split a driver batch over DP replicas by token count, and put gathered per-row results back in order.

Pure functions. Balancing is the Karmarkar-Karp largest differencing method of ``data/dynamic_batch.py`` (as verl
balances its batches), with equal row counts per replica (DP collectives and pipeline schedules want the same
number of micro-batches everywhere): when the row count is not a multiple of dp, the counts differ by at most one.
Each shard lists its rows in ascending original order; ``restore_rows`` inverts the permutation.
``balance=False`` (``trainer.balance_batch=false``) splits into contiguous blocks of rows instead, the same counts.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_ppo.data.dynamic_batch import karmarkar_karp, restore_order, token_imbalance

__all__ = ["split_rows", "select_rows", "restore_rows", "token_imbalance"]


def split_rows(lengths: Sequence[int], dp: int, balance: bool = True) -> list[list[int]]:
    """Row indices for each of ``dp`` replicas: near-equal token sums, row counts equal (or within one).

    Rows that do not divide evenly are handled by zero-length placeholders: Karmarkar-Karp's equal-size mode
    puts the (fewer than dp) placeholders in different replicas, which then get one real row less.
    ``balance=False``: contiguous blocks in row order (the first ``n % dp`` replicas one row more), tokens ignored.
    """
    n = len(lengths)
    if dp < 1:
        raise ValueError(f"split_rows: dp={dp} must be >= 1")
    if n < dp:
        raise ValueError(f"split_rows: {n} rows cannot feed {dp} DP replicas (every replica needs at least one row)")
    for i, length in enumerate(lengths):
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ValueError(f"split_rows: row {i} has length {length!r}; lengths must be ints >= 0")
    if dp == 1:
        return [list(range(n))]
    if not balance:
        base, extra = divmod(n, dp)
        bounds = [d * base + min(d, extra) for d in range(dp + 1)]
        return [list(range(bounds[d], bounds[d + 1])) for d in range(dp)]
    pad = (-n) % dp
    # Placeholders weigh -1 so that they sort below every real row (even 0-token ones) and seed distinct replicas.
    weights = list(lengths) + [-1] * pad
    parts = karmarkar_karp(weights, dp, equal_size=True)
    return [[i for i in part if i < n] for part in parts]


def select_rows(batch: Any, rows: Sequence[int]) -> Any:
    """The given rows of a batch: a tensor (dim 0), a list/tuple, a dict of those (recursively), or an object with
    ``select(rows)`` (data.batch.RolloutBatch)."""
    if hasattr(batch, "select") and not isinstance(batch, (torch.Tensor, dict, list, tuple)):
        return batch.select(rows)
    if isinstance(batch, torch.Tensor):
        return batch[torch.as_tensor(list(rows), dtype=torch.long, device=batch.device)]
    if isinstance(batch, dict):
        return {key: select_rows(value, rows) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [batch[i] for i in rows]
    raise TypeError(f"select_rows: cannot take rows of a {type(batch).__name__} (tensor, list or dict of those)")


def restore_rows(results: Sequence[Any], shards: Sequence[Sequence[int]]) -> Any:
    """Per-replica results (rows in shard order) -> one result with rows in the original order.

    Each result is a tensor (rows along dim 0), a list, or a dict of those with the same keys on every replica.
    A replica that returns a different number of rows than it was given is an error naming the replica and key.
    """
    if len(results) != len(shards):
        raise ValueError(f"restore_rows: {len(results)} results for {len(shards)} shards")
    return _restore(list(results), [list(s) for s in shards], "result")


def _restore(results: list, shards: list[list[int]], what: str):
    first = results[0]
    if isinstance(first, dict):
        for d, r in enumerate(results):
            if not isinstance(r, dict) or set(r) != set(first):
                got = sorted(r) if isinstance(r, dict) else type(r).__name__
                raise ValueError(f"restore_rows: {what} of DP replica {d} has keys {got}, replica 0 has {sorted(first)}")
        return {key: _restore([r[key] for r in results], shards, f"{what}[{key!r}]") for key in first}
    for d, (r, rows) in enumerate(zip(results, shards)):
        if not isinstance(r, (torch.Tensor, list, tuple)):
            raise TypeError(f"restore_rows: {what} of DP replica {d} is a {type(r).__name__}; per-row results must "
                            "be tensors, lists or dicts of those")
        if len(r) != len(rows):
            raise ValueError(f"restore_rows: {what} of DP replica {d} has {len(r)} rows, it was given {len(rows)}")
    if isinstance(first, torch.Tensor):
        return restore_order(torch.cat(list(results), dim=0), shards)
    return restore_order([row for r in results for row in r], shards)
