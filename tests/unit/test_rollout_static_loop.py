"""The static loop's pure pieces: batch buckets, the prefill token budget, the lagged alive count."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.rollout.static_loop import AliveCount, batch_buckets, bucket_for, prefill_chunks, use_cuda_graphs


def test_buckets_are_the_batch_then_powers_of_two_or_the_configured_sizes():
    assert batch_buckets(48) == [48, 32, 16, 8, 4, 2, 1]
    assert batch_buckets(64) == [64, 32, 16, 8, 4, 2, 1]
    assert batch_buckets(1) == [1]
    assert batch_buckets(48, (6, 3, 100, 48)) == [48, 6, 3]  # sizes at or above the batch are not buckets
    assert bucket_for(33, batch_buckets(48)) == 48 and bucket_for(32, batch_buckets(48)) == 32
    assert bucket_for(5, batch_buckets(48)) == 8 and bucket_for(1, batch_buckets(48)) == 1
    assert bucket_for(4, [48, 6, 3]) == 6 and bucket_for(0, [48, 6, 3]) == 3


def test_prefill_chunks_hold_the_token_budget_and_every_row_once():
    lengths = [100, 90, 90, 40, 40, 40, 40, 5]
    groups = [(0, 3), (3, 7), (7, 8)]
    chunks = prefill_chunks(groups, lengths, token_budget=200)
    assert chunks == [(0, 2), (2, 3), (3, 7), (7, 8)]
    assert all((j - i) * lengths[i] <= 200 for i, j in chunks)
    assert [r for i, j in chunks for r in range(i, j)] == list(range(8))
    assert prefill_chunks([(0, 2)], [500, 400], token_budget=100) == [(0, 1), (1, 2)]  # one row even over budget


def test_alive_count_is_read_once_per_interval_one_step_late():
    count = AliveCount(4, "cpu")
    alive = torch.ones(6, dtype=torch.bool)
    seen = {}
    for step in range(12):
        if step < 6:
            alive[step] = step % 2 == 0  # rows 1, 3, 5 finish at steps 1, 3, 5
        value = count.poll(alive, step)
        if value is not None:
            seen[step] = value
    assert seen == {4: 4, 8: 3}  # issued after steps 3 and 7, read after steps 4 and 8
    with pytest.raises(ValueError, match="alive_check_interval"):
        AliveCount(0, "cpu")


def test_cuda_graphs_setting():
    assert not use_cuda_graphs("auto", "cpu") and not use_cuda_graphs("false", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        use_cuda_graphs("true", "cpu")
    with pytest.raises(ValueError, match="one of"):
        use_cuda_graphs("yes", "cpu")
