"""Balanced partitions: samples across data-parallel ranks, and dynamic micro-batches under a token budget.

Pure functions on lengths (lists of ints) returning index lists, so the driver can plan on CPU and the Megatron
workers can reuse the same code. Balancing uses the Karmarkar-Karp largest differencing method, as verl does.
Micro-batch plans give every DP rank the same number of micro-batches (pipeline schedules and collectives need
that), as verl's `rearrange_micro_batches` does; `restore_order` undoes the permutation after compute.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable, Sequence

import torch


def karmarkar_karp(weights: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices of `weights` into k subsets with near-equal sums (multi-way largest differencing method).

    Each item starts as a k-subset "state"; the two states with the largest spread (max - min sum) are merged,
    pairing the heaviest subset of one with the lightest of the other, until one state remains.
    equal_size=True seeds states with k items of consecutive sorted weight (one per subset), so every subset ends
    with len(weights) / k items. Returns k index lists, each sorted.
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"k={k} partitions must be >= 1")
    if n < k:
        raise ValueError(f"cannot split {n} items into {k} non-empty partitions")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs the item count ({n}) divisible by k={k}")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    tie = itertools.count()
    heap = []

    def push(state: list[tuple[float, list[int]]]) -> None:
        state.sort(key=lambda s: s[0], reverse=True)
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), -state[0][0], next(tie), state))

    if equal_size:
        for start in range(0, n, k):
            push([(weights[i], [i]) for i in order[start:start + k]])
    else:
        for i in order:
            push([(weights[i], [i])] + [(0, []) for _ in range(k - 1)])
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        push([(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)])
    return [sorted(items) for _, items in heap[0][3]]


def balance_across_ranks(lengths: Sequence[int], dp_size: int, equal_size: bool = True) -> list[list[int]]:
    """Assign samples to `dp_size` ranks with near-equal token totals (equal sample counts by default)."""
    return karmarkar_karp(list(lengths), dp_size, equal_size=equal_size)


def token_imbalance(lengths: Sequence[int], partitions: Sequence[Sequence[int]]) -> float:
    """max partition tokens / mean partition tokens - 1 (0 = perfectly balanced)."""
    totals = [sum(lengths[i] for i in p) for p in partitions]
    mean = sum(totals) / len(totals)
    return max(totals) / mean - 1.0 if mean else 0.0


def attention_workload(length: int) -> int:
    """verl's per-sequence cost estimate (dense 7B-like blocks: linear term + quadratic attention term)."""
    return 24576 * length + length * length


def plan_micro_batches(
    lengths_per_rank: Sequence[Sequence[int]],
    max_token_len: int,
    *,
    min_num_micro_batches: int = 1,
    divisible_by: int = 1,
    balance: str = "workload",
    reduce_max: Callable[[int], int] | None = None,
) -> list[list[list[int]]]:
    """Micro-batches for each rank: token sum of each <= max_token_len, the same count on every rank.

    lengths_per_rank: valid tokens of each sample, per DP rank (the driver passes all ranks; a worker passes its
        own single list together with `reduce_max`, an all-reduce MAX over its DP group, so ranks agree).
    divisible_by: micro-batch count multiple (virtual pipeline stages), like verl's num_batches_divided_by.
    balance: "workload" (verl's attention-aware cost) or "tokens" — what Karmarkar-Karp equalises inside a rank.
    Returns, per rank, a list of micro-batches, each a sorted list of that rank's sample indices.
    """
    if max_token_len < 1:
        raise ValueError(f"max_token_len={max_token_len} must be >= 1")
    if balance not in ("workload", "tokens"):
        raise ValueError(f"balance={balance!r}; choose 'workload' or 'tokens'")
    sync = reduce_max or (lambda v: v)
    for rank, lengths in enumerate(lengths_per_rank):
        for i, n in enumerate(lengths):
            if n > max_token_len:
                raise ValueError(f"rank {rank}: sample {i} has {n} tokens > max_token_len={max_token_len} "
                                 "(ppo_max_token_len_per_gpu); a sample cannot be split across micro-batches")
    fewest = -sync(-min(len(lengths) for lengths in lengths_per_rank))
    needed = max(math.ceil(sum(lengths) / max_token_len) for lengths in lengths_per_rank)
    num = sync(max(needed, min_num_micro_batches, 1))
    num = -(-num // divisible_by) * divisible_by
    weigh = attention_workload if balance == "workload" else (lambda n: n)
    while True:
        if num > fewest:
            raise ValueError(f"need {num} micro-batches per rank but a rank has only {fewest} samples "
                             f"(max_token_len={max_token_len}, divisible_by={divisible_by})")
        plans = [karmarkar_karp([weigh(n) for n in lengths], num) for lengths in lengths_per_rank]
        fits = all(sum(lengths[i] for i in mb) <= max_token_len
                   for lengths, plan in zip(lengths_per_rank, plans) for mb in plan)
        if sync(0 if fits else 1) == 0:
            return [sorted(plan, key=lambda mb: mb[0]) for plan in plans]
        num += divisible_by


def restore_order(values, micro_batch_indices: Sequence[Sequence[int]]):
    """Outputs concatenated in micro-batch order -> original sample order (tensor along dim 0, or a list)."""
    flat = [i for mb in micro_batch_indices for i in mb]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError("micro_batch_indices is not a permutation of 0..N-1")
    if len(values) != len(flat):
        raise ValueError(f"{len(values)} values for {len(flat)} indexed samples")
    inverse = [0] * len(flat)
    for pos, i in enumerate(flat):
        inverse[i] = pos
    if isinstance(values, torch.Tensor):
        return values[torch.as_tensor(inverse, device=values.device)]
    return [values[j] for j in inverse]


def all_reduce_max(group=None) -> Callable[[int], int]:
    """`reduce_max` for plan_micro_batches on a worker: MAX over a torch.distributed group (gloo or NCCL)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"

    def reduce(value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    return reduce
