"""Measured parameter, gradient and optimizer memory of a real Megatron shard, to check the planner against.

``measure_rank`` runs in a rank (LocalWorkerPool): builds the actor stage at fp32 on CPU, wraps it in Megatron DDP
and the Megatron optimizer (distributed or not), takes one optimizer step on zero gradients so that Adam's states
exist, and reports the process RSS growth after each, next to what ``plan.memory`` predicts for that rank. RSS
works as a measure here because every one of these tensors is written when it is created (init, zeros).
"""
from __future__ import annotations

import gc

from megatron_ppo.models.arch import ModelArch
from megatron_ppo.plan.memory import Layout, Workload, memory, stage_params


def _rss() -> int:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def measure_rank(rank: int, world_size: int, arch_dict: dict, tp: int, pp: int, distributed_optimizer: bool) -> dict:
    import torch
    from megatron.core import parallel_state

    from megatron_ppo import parallel
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.training import OptimizerSettings, build_optimizer, wrap_ddp

    arch = ModelArch(**arch_dict)
    parallel.initialize(tp=tp, pp=pp, seed=1234)
    try:
        dp = parallel_state.get_data_parallel_world_size()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        r0 = _rss()
        model = build_gpt_model(arch, role="actor", params_dtype=torch.float32)
        r1 = _rss()
        ddp = wrap_ddp(model, use_distributed_optimizer=distributed_optimizer)
        r2 = _rss()
        opt = build_optimizer(ddp, OptimizerSettings(lr=1e-4, use_distributed_optimizer=distributed_optimizer))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        opt.step()  # zero gradients: Adam's states are created, the weights barely move
        r3 = _rss()
        params = sum(p.numel() for p in model.parameters())
        planned = stage_params(arch, "actor", tp, pp, stage).total
        layout = Layout(tp=tp, pp=pp, dp=dp, distributed_optimizer=distributed_optimizer)
        pred = memory(arch, "actor", layout, Workload(seq_len=8, micro_batch=1, param_bytes=4))
        # memory() reports the worst stage; this rank's own stage:
        scale = planned / pred.params
        del opt, ddp, model
        return {"rank": rank, "tp": tp, "pp": pp, "dp": dp, "distributed_optimizer": distributed_optimizer,
                "stage": stage, "params": params, "planned_params": planned,
                "measured": {"weights": r1 - r0, "grads": r2 - r1, "optimizer": r3 - r2},
                "predicted": {"weights": planned * 4, "grads": planned * 4,
                              "optimizer": round(pred.optimizer * scale)}}
    finally:
        parallel.destroy(destroy_process_group=False)
        gc.collect()


MEASURE_ARCH = dict(num_layers=4, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8, num_query_groups=4,
                    vocab_size=16000, max_position_embeddings=256)
LAYOUTS = ((1, 1, False), (1, 1, True), (2, 1, False), (1, 2, False))  # (tp, pp, distributed optimizer) on 2 ranks


def measure_layouts(pool, arch_dict: dict = MEASURE_ARCH, layouts=LAYOUTS) -> list[dict]:
    """Every layout on a 2-rank pool: one dict per (layout, rank)."""
    out = []
    # warm-up, discarded: the first build in a fresh rank process pays one-time allocations (library state, first
    # collectives) that the RSS deltas would charge to the weights (a visible error on the first layout otherwise)
    pool.run(measure_rank, arch_dict, *layouts[0])
    for tp, pp, dist in layouts:
        out += pool.run(measure_rank, arch_dict, tp, pp, dist)
    return out
