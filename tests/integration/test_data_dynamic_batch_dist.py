"""plan_micro_batches on real torch.distributed ranks (gloo): each rank plans alone with all_reduce_max and gets
exactly the plan the driver computes for all ranks at once — same micro-batch count everywhere."""
import json
import random

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ppo.data.dynamic_batch import all_reduce_max, plan_micro_batches

WORLD, BUDGET = 3, 1500


def _ranks():
    rng = random.Random(4)
    # skewed ranks on purpose: rank 2 holds the long sequences, so it alone needs more micro-batches
    return [[rng.randint(10, 300) for _ in range(24)], [rng.randint(10, 300) for _ in range(20)],
            [rng.randint(600, 1400) for _ in range(18)]]


def _worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        plan = plan_micro_batches([_ranks()[rank]], BUDGET, divisible_by=2, reduce_max=all_reduce_max())[0]
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(plan, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_rank_plans_alone_and_agrees(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = plan_micro_batches(_ranks(), BUDGET, divisible_by=2)
    assert got == expected
    counts = {len(p) for p in got}
    assert len(counts) == 1 and counts.pop() > -(-sum(_ranks()[0]) // BUDGET)  # rank 0 padded up to rank 2's count
