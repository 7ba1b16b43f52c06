"""A few optimizer steps: DP=2 (2 gloo ranks) lowers the loss exactly like DP=1 with gradient accumulation over the
same micro-batches, with megatron's DDP + Adam (grad clipping on), with the distributed optimizer, and with it and
NCCL's communication overlap (gradients reduced per bucket during the backward, parameters gathered per bucket in
the next forward: models/training.ddp_overlap), forced on over gloo with small buckets."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 3


def _data(vocab):
    from megatron_ppo.models.forward import pack_sequences

    g = torch.Generator().manual_seed(21)
    mbs = []  # 4 packed micro-batches of different sizes, fitted for STEPS steps
    for lens in ([7, 9], [12], [5, 4, 6], [10, 3]):
        ids, cu = pack_sequences([torch.randint(0, vocab, (n,), generator=g) for n in lens])
        mbs.append({"input_ids": ids, "cu_seqlens": cu})
    return [mbs] * STEPS


def _train(dp_rank, dp_size, full_sd, use_distributed_optimizer, overlap=False):
    import torch.distributed as dist

    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.logprobs import next_token_targets, vocab_parallel_logprobs_entropy
    from megatron_ppo.models.training import OptimizerSettings, build_optimizer, sync_params, wrap_ddp
    from megatron_ppo.testing.sharding import gather_full_state_dict, load_full_state_dict
    from megatron_ppo.testing.training import train_step

    arch = tiny_arch()
    model = build_gpt_model(arch, "actor")
    load_full_state_dict(model, full_sd)
    ddp = wrap_ddp(model, use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=overlap,
                   overlap_param_gather=overlap, bucket_size=20000 if overlap else None)
    assert not overlap or len(ddp.bucket_groups) > 2  # several buckets, each reduced / gathered on its own
    opt = build_optimizer(ddp, OptimizerSettings(lr=3e-3, clip_grad=0.5,
                                                 use_distributed_optimizer=use_distributed_optimizer))
    losses, norms = [], []
    for mbs in _data(arch.vocab_size):
        n_tokens = sum(int(next_token_targets(b["input_ids"], b["cu_seqlens"])[1].sum()) for b in mbs)
        mine = mbs[dp_rank::dp_size]

        def loss_fn(logits, batch):
            t, v = next_token_targets(batch["input_ids"], batch["cu_seqlens"])
            logp, _ = vocab_parallel_logprobs_entropy(logits, t, vocab_size=arch.vocab_size)
            nll_sum = -(logp * v).sum()
            return nll_sum / n_tokens * dp_size, {"nll_sum": nll_sum.detach()}  # DDP averages over DP

        metrics, ok, grad_norm = train_step(ddp, opt, mine, loss_fn)
        assert ok
        total = torch.stack([m["nll_sum"] for m in metrics]).sum()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(total)
        losses.append((total / n_tokens).item())
        norms.append(float(grad_norm))
    sync_params(ddp)  # the last step's weights: with overlap_param_gather no forward has gathered them yet
    return {"losses": losses, "norms": norms, "weights": gather_full_state_dict(model)}


def _job_dp2(rank, world, full_sd, use_distributed_optimizer, overlap):
    from megatron_ppo import parallel

    parallel.initialize(tp=1, pp=1, seed=1)
    try:
        assert parallel.dp_size() == 2
        return _train(parallel.dp_rank(), 2, full_sd, use_distributed_optimizer, overlap)
    finally:
        parallel.destroy(destroy_process_group=False)


@pytest.fixture(scope="module")
def dp1_reference():
    from megatron_ppo import parallel
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.parallel.platform import disable_cpu_platform

    parallel.initialize(seed=1)
    try:
        full_sd = {k: v.clone() for k, v in build_gpt_model(tiny_arch(), "actor").state_dict().items()
                   if not k.endswith("_extra_state")}
        return full_sd, _train(0, 1, full_sd, False)
    finally:
        parallel.destroy()
        disable_cpu_platform()


@pytest.mark.parametrize("use_distributed_optimizer,overlap", [(False, False), (True, False), (True, True)])
def test_dp2_matches_dp1_grad_accumulation(dist_pool2, dp1_reference, use_distributed_optimizer, overlap):
    full_sd, ref = dp1_reference
    assert ref["losses"][-1] < ref["losses"][0]  # training does lower the loss
    for rank, r in enumerate(dist_pool2.run(_job_dp2, full_sd, use_distributed_optimizer, overlap)):
        for step, (a, b) in enumerate(zip(ref["losses"], r["losses"])):
            assert abs(a - b) <= 1e-5 * abs(a), f"rank {rank} step {step}: loss {b} vs DP1 {a}"
        for step, (a, b) in enumerate(zip(ref["norms"], r["norms"])):
            assert abs(a - b) <= 1e-5 * abs(a), f"rank {rank} step {step}: grad norm {b} vs DP1 {a}"
        for name, w in ref["weights"].items():
            torch.testing.assert_close(r["weights"][name], w, atol=2e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
