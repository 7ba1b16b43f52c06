"""Karmarkar-Karp partitions and token-budget micro-batches, checked against verl 0.9.1 on the same lengths."""
import os
import random

import pytest
import torch

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")

from megatron_ppo.data.dynamic_batch import (  # noqa: E402
    attention_workload, balance_across_ranks, karmarkar_karp, plan_micro_batches, restore_order, token_imbalance,
)


def _sums(weights, parts):
    return sorted(sum(weights[i] for i in p) for p in parts)


@pytest.mark.parametrize("equal_size", [True, False])
def test_karmarkar_karp_matches_verl(equal_size):
    from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

    rng = random.Random(0)
    for _ in range(150):
        k = rng.choice([2, 3, 4, 8])
        n = rng.choice([k, 2 * k, 5 * k, 32 * k]) + (0 if equal_size else rng.randint(0, k - 1))
        lengths = [rng.randint(1, 4096) for _ in range(n)]
        ours = karmarkar_karp(lengths, k, equal_size)
        theirs = get_seqlen_balanced_partitions(lengths, k, equal_size)
        assert sorted(i for p in ours for i in p) == list(range(n)) and all(p == sorted(p) for p in ours)
        if equal_size:
            assert {len(p) for p in ours} == {n // k}
        assert _sums(lengths, ours) == _sums(lengths, theirs)  # same balance, partition for partition


def test_balance_across_8_ranks_beats_contiguous_split():
    rng = random.Random(1)
    lengths = [rng.randint(40, 900) for _ in range(512)]
    parts = balance_across_ranks(lengths, 8)
    contiguous = [list(range(r * 64, (r + 1) * 64)) for r in range(8)]
    assert {len(p) for p in parts} == {64}
    assert token_imbalance(lengths, parts) < 0.001 < token_imbalance(lengths, contiguous)


def _verl_micro_batches(lengths, budget):
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    _, idx = rearrange_micro_batches(TensorDict({"input_ids": mask, "attention_mask": mask},
                                                batch_size=[len(lengths)]), budget)
    return idx


def test_single_rank_micro_batches_match_verl():
    rng = random.Random(2)
    for _ in range(40):
        lengths = [rng.randint(8, 600) for _ in range(rng.randint(4, 64))]
        budget = rng.choice([600, 1000, 2048, 4096])
        ours = plan_micro_batches([lengths], budget)[0]
        theirs = _verl_micro_batches(lengths, budget)
        assert len(ours) == len(theirs)
        workload = [attention_workload(n) for n in lengths]
        assert _sums(workload, ours) == _sums(workload, theirs)


@pytest.mark.parametrize("divisible_by", [1, 2, 4])
def test_dp_plan_respects_budget_and_equal_counts(divisible_by):
    rng = random.Random(3)
    for trial in range(30):
        # as the driver does: balance a global batch across 4 DP ranks, then plan micro-batches on each rank
        global_batch = [rng.randint(1, 700) for _ in range(4 * rng.randint(8, 40))]
        ranks = [[global_batch[i] for i in part] for part in balance_across_ranks(global_batch, 4)]
        budget = rng.choice([700, 1200, 3000])
        plan = plan_micro_batches(ranks, budget, divisible_by=divisible_by, balance=rng.choice(["tokens", "workload"]))
        counts = {len(mbs) for mbs in plan}
        assert len(counts) == 1 and counts.pop() % divisible_by == 0
        for lengths, mbs in zip(ranks, plan):
            assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
            assert all(mb and sum(lengths[i] for i in mb) <= budget for mb in mbs)
        # the count is the smallest the slowest rank allows, unless balancing forced one more
        lower = max(-(-sum(lengths) // budget) for lengths in ranks)
        assert len(plan[0]) >= lower


def test_restore_order_tensor_and_list():
    lengths = [5, 300, 20, 280, 7, 150, 90]
    mbs = plan_micro_batches([lengths], 320)[0]
    values = torch.arange(len(lengths)) * 10
    outputs = torch.cat([values[mb] for mb in mbs])  # computed micro-batch by micro-batch
    assert torch.equal(restore_order(outputs, mbs), values)
    assert restore_order([f"r{i}" for mb in mbs for i in mb], mbs) == [f"r{i}" for i in range(len(lengths))]
    with pytest.raises(ValueError, match="not a permutation"):
        restore_order(values, [[0, 1], [1]])


def test_bad_inputs_name_rank_and_sample():
    with pytest.raises(ValueError, match=r"rank 1: sample 2 has 900 tokens > max_token_len=800"):
        plan_micro_batches([[10, 20], [10, 20, 900]], 800)
    with pytest.raises(ValueError, match="a rank has only 2 samples"):
        plan_micro_batches([[500, 500, 500], [500, 500]], 600)
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        karmarkar_karp([1, 2], 3)
    with pytest.raises(ValueError, match="divisible by k=2"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
