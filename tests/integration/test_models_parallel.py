"""TP=2, TP=2+SP and PP=2 give the TP=1 logits, log-probs, entropies, values and gradients (fp32, real megatron-core,
gloo, 2 spawned ranks). The TP=1 reference runs on the same ranks (as DP=2 replicas of identical data); its full
weights are then sliced into the other layout with megatron's own partition attributes."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

TOL = 2e-5


def _micro_batches(vocab, align):
    from megatron_ppo.models.forward import pack_sequences

    g = torch.Generator().manual_seed(7)
    lens = [[9, 14, 5], [11, 6]]  # two micro-batches of different sizes (dynamic batching)
    out = []
    for mb in lens:
        seqs = [torch.randint(0, vocab, (n,), generator=g) for n in mb]
        ids, cu = pack_sequences(seqs, align=align)
        w = torch.randn(3, ids.shape[1], generator=g, dtype=torch.float64).float()
        out.append({"input_ids": ids, "cu_seqlens": cu, "w": w})
    return out


def _run(role, sequence_parallel, micro_batches, full_sd=None, vocab=None):
    """Build `role`, optionally load full weights, forward+backward the micro-batches through the schedule."""
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.logprobs import next_token_targets, vocab_parallel_logprobs_entropy
    from megatron_ppo.models.schedule import forward_backward
    from megatron_ppo.models.training import wrap_ddp
    from megatron_ppo.testing.sharding import gather_full_state_dict, load_full_state_dict

    arch = tiny_arch(vocab_size=vocab, tie_word_embeddings=(role == "actor"))
    model = build_gpt_model(arch, role, sequence_parallel=sequence_parallel)
    if full_sd is not None:
        load_full_state_dict(model, full_sd)
    weights = gather_full_state_dict(model)
    ddp = wrap_ddp(model)
    ddp.zero_grad_buffer()

    def loss_fn(output, batch):
        w = batch["w"]
        if role == "actor":
            targets, valid = next_token_targets(batch["input_ids"], batch["cu_seqlens"])
            logp, ent = vocab_parallel_logprobs_entropy(output, targets, vocab_size=vocab, temperature=0.9)
            loss = ((w[0] * logp + w[1] * ent) * valid).sum()
            return loss, {"logits": output.detach().clone(), "logp": logp.detach(), "ent": ent.detach()}
        values = output.squeeze(-1)
        return (w[2] * values).sum(), {"values": values.detach()}

    metrics = forward_backward([ddp], micro_batches, loss_fn)
    grads = gather_full_state_dict(model, grads=True)
    return weights, metrics, grads


def _job_equivalence(rank, world, layout, role):
    from megatron_ppo import parallel

    vocab = 500  # padded to 512: exercises the vocab-padding mask
    mbs = _micro_batches(vocab, align=2)
    parallel.initialize(tp=1, pp=1, seed=11)
    try:
        ref_w, ref_m, ref_g = _run(role, False, mbs, vocab=vocab)
    finally:
        parallel.destroy(destroy_process_group=False)
    tp, pp, sp = {"tp2": (2, 1, False), "tp2sp": (2, 1, True), "pp2": (1, 2, False),
                  "tp2pp2sp": (2, 2, True)}[layout]
    parallel.initialize(tp=tp, pp=pp, seed=99)  # another seed: the weights must come from the TP1 model
    try:
        _, got_m, got_g = _run(role, sp, mbs, full_sd=ref_w, vocab=vocab)
        tp_rank, tp_size = parallel.tp_rank(), parallel.tp_size()
        last = parallel.is_last_stage()
    finally:
        parallel.destroy(destroy_process_group=False)

    diffs = {}
    if last:
        for i, (a, b) in enumerate(zip(ref_m, got_m)):
            for key in a:
                ref = a[key]
                if key == "logits":  # this rank's vocab shard of the TP1 logits
                    v = b[key].shape[-1]
                    ref = ref[..., tp_rank * v:(tp_rank + 1) * v]
                diffs[f"mb{i}.{key}"] = (ref - b[key]).abs().max().item()
    for name, g in got_g.items():
        ref = ref_g[name]
        if ref.shape != g.shape:  # vocab re-padding: compare the true vocab rows
            ref, g = ref[:vocab], g[:vocab]
        scale = max(ref.abs().max().item(), 1e-3)
        diffs[f"grad.{name}"] = (ref - g).abs().max().item() / scale
    return {"last": last, "diffs": diffs, "n_grads": len(got_g)}


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2"])
def test_layout_matches_tp1(dist_pool2, layout, role):
    results = dist_pool2.run(_job_equivalence, layout, role)
    assert any(r["last"] for r in results)
    for rank, r in enumerate(results):
        assert r["n_grads"] > 0
        bad = {k: v for k, v in r["diffs"].items() if not v <= TOL}
        assert not bad, f"rank {rank} {layout} {role}: differences above {TOL}: {bad}"
    if layout == "pp2":  # the last stage reports outputs, both stages report their own gradients
        keys = set().union(*(r["diffs"] for r in results))
        assert any(k.startswith("mb1.") for k in keys)


@pytest.fixture(scope="module")
def dist_pool4():
    """4 ranks on the 2-core machine: slow to start (4 megatron imports), so one module-scoped pool."""
    from megatron_ppo.parallel.launch import LocalWorkerPool

    with LocalWorkerPool(4) as pool:
        yield pool


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_tp2_pp2_sp_matches_tp1(dist_pool4, role):
    results = dist_pool4.run(_job_equivalence, "tp2pp2sp", role)
    assert sum(r["last"] for r in results) == 2  # the two TP ranks of the last stage
    for rank, r in enumerate(results):
        bad = {k: v for k, v in r["diffs"].items() if not v <= TOL}
        assert not bad, f"rank {rank} tp2pp2sp {role}: differences above {TOL}: {bad}"
