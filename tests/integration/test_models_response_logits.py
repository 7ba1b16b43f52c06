"""The actor's and reference's LM head runs only at the positions that predict response tokens (``logit_positions``,
models/gpt.py) and gives the full-logits path's log-probs, entropies, loss and gradients: one process (fp32/bf16,
tied/untied, actor/reference, one PPO update) and 2 gloo ranks (TP2, TP2+SP, PP2; slow). Real megatron-core.

The full path is the same micro-batch without ``logit_positions`` (the model then returns [1, T, V/TP])."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

VOCAB = 500  # padded to 512 (and to 512 at TP2): the vocab-padding mask is exercised
TEMPERATURE = 0.9


def _batch(vocab: int = VOCAB, seed: int = 5):
    """Five rows with prompts longer than their responses (as GSM8K), ragged responses, one of length 1."""
    from megatron_ppo.data.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt_lens, resp_lens, width = [13, 9, 17, 11, 6], [5, 1, 7, 3, 7], 7
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in prompt_lens]
    responses = torch.randint(0, vocab, (5, width), generator=g)
    mask = (torch.arange(width) < torch.tensor(resp_lens)[:, None]).float()
    responses = torch.where(mask.bool(), responses, torch.zeros_like(responses))
    tensors = {"old_log_probs": -2 + 0.3 * torch.randn(5, width, generator=g),
               "ref_log_probs": -2 + 0.3 * torch.randn(5, width, generator=g),
               "advantages": torch.randn(5, width, generator=g)}
    return RolloutBatch(prompts, responses, mask, tensors)


def _full(micro: dict) -> dict:
    return {k: v for k, v in micro.items() if k not in ("logit_positions", "logit_index")}


def test_logit_positions_are_the_distinct_positions_resp_pos_reads():
    from megatron_ppo.data.batch import at_logit_positions, pack_rows

    batch = _batch()
    micro = pack_rows(batch, [0, 1, 2, 3, 4], align=4)
    pos, index, resp_pos = micro["logit_positions"], micro["logit_index"], micro["resp_pos"]
    assert torch.equal(pos[index], resp_pos)
    assert bool((pos[1:] > pos[:-1]).all()) and set(pos.tolist()) == set(resp_pos.reshape(-1).tolist())
    total = micro["input_ids"].numel()
    # the response tokens (23) plus one slot per row whose response is shorter than the width (3 rows)
    assert pos.numel() == int(batch.response_mask.sum()) + 3 < total
    assert at_logit_positions(pos.numel(), micro) and not at_logit_positions(total, micro)
    with pytest.raises(ValueError, match=f"model output has {total - 1} positions.*expects {total}"):
        at_logit_positions(total - 1, micro)


def _logprobs(model, micros):
    """Forward-only log-probs/entropy through the schedule, and the model output's length along the sequence."""
    from megatron_ppo.models.schedule import forward_backward
    from megatron_ppo.workers.losses import logprob_output_fn

    out_fn, lengths = logprob_output_fn(VOCAB, TEMPERATURE), []

    def fn(logits, micro):
        lengths.append(logits.shape[1])
        return logits.new_zeros(()), out_fn(logits, micro)

    with torch.no_grad():
        outs = forward_backward(model, micros, fn, forward_only=True)
    return outs, lengths


@pytest.mark.parametrize("role", ["actor", "ref"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.0)], ids=["fp32", "bf16"])
def test_logprobs_at_response_positions_equal_the_full_path(megatron_single, role, tied, dtype, tol):
    from megatron_ppo.data.batch import pack_rows
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB, tie_word_embeddings=tied), role, params_dtype=dtype).eval()
    batch = _batch()
    micros = [pack_rows(batch, rows) for rows in ([0, 1, 2], [3, 4])]
    got, got_len = _logprobs(model, micros)
    ref, ref_len = _logprobs(model, [_full(m) for m in micros])
    assert got_len == [m["logit_positions"].numel() for m in micros]  # the LM head ran at those positions only
    assert ref_len == [m["input_ids"].shape[1] for m in micros] and all(a < b for a, b in zip(got_len, ref_len))
    for g, r, m in zip(got, ref, micros):
        assert g["log_probs"].shape == m["resp_pos"].shape
        for key in ("log_probs", "entropy"):
            diff = (g[key] - r[key]).abs().max().item()
            assert diff <= tol, f"{role} {dtype} tied={tied}: {key} differs from the full path by {diff}"


def _actor_cfg():
    from megatron_ppo.config import load_config

    cfg = load_config("tiny_cpu", ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.entropy_coeff=0.01",
                                   "actor.clip_ratio=0.2"])
    return cfg.actor


def _optim():
    return SimpleNamespace(lr=1e-3, weight_decay=0.01, betas=[0.9, 0.999], clip_grad=1.0, lr_warmup_steps=0,
                           lr_warmup_steps_ratio=0.0, lr_warmup_init=0.0, lr_decay_steps=None,
                           lr_decay_style="constant", min_lr=0.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)], ids=["fp32", "bf16"])
def test_actor_update_at_response_positions_equals_the_full_path(megatron_single, dtype, tol):
    """One PPO update (clip + entropy bonus + KL loss) of two copies of the actor: same loss, gradient norm,
    gradients and updated weights whether the LM head ran on the response positions or on every token."""
    from megatron_ppo.data.batch import pack_rows
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.workers.losses import actor_loss_fn
    from megatron_ppo.workers.megatron_worker import MegatronWorker

    from megatron_ppo import parallel

    arch = tiny_arch(vocab_size=VOCAB)  # tied embeddings (SmolLM2's)
    workers = []
    for _ in range(2):  # same seed: same weights, and the bf16 optimizer's fp32 main copies too
        parallel.seed_everything(21)
        workers.append(MegatronWorker("actor", arch, optim=_optim(), params_dtype=dtype))
    new, old = workers
    assert all(torch.equal(p, q) for p, q in zip(new.model.parameters(), old.model.parameters()))
    batch = _batch()
    keys = ("old_log_probs", "advantages", "ref_log_probs")
    micros = [pack_rows(batch, rows, keys) for rows in ([0, 1, 2], [3, 4])]
    loss_fn = actor_loss_fn(_actor_cfg(), vocab_size=VOCAB, temperature=TEMPERATURE,
                            mini_batch_tokens=int(batch.loss_mask.sum()), mini_batch_seqs=batch.size)
    got = new.train_step(micros, loss_fn)
    ref = old.train_step([_full(m) for m in micros], loss_fn)
    assert got["update_skipped"] == ref["update_skipped"] == 0.0
    assert abs(got["loss"] - ref["loss"]) <= tol * max(1.0, abs(ref["loss"]))
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= tol * ref["grad_norm"] and ref["grad_norm"] > 0
    for a, b in zip(got["micro"], ref["micro"]):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol * max(1.0, abs(b[k])) for k in a)
    params = dict(old.model.named_parameters())
    for name, p in new.model.named_parameters():
        q = params[name]
        grad_diff = (p.main_grad - q.main_grad).abs().max().item()
        assert grad_diff <= tol * max(q.main_grad.abs().max().item(), 1e-3), f"{name}: grads differ by {grad_diff}"
        weight_diff = (p.float() - q.float()).abs().max().item()
        assert weight_diff <= tol * max(q.float().abs().max().item(), 1e-3), f"{name}: weights differ by {weight_diff}"


def test_value_models_ignore_logit_positions(megatron_single):
    """The critic's [H, 1] head still sees every position: values [1, T, 1] for a pack_rows micro-batch."""
    from megatron_ppo.data.batch import pack_rows
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.forward import model_forward
    from megatron_ppo.models.gpt import build_gpt_model

    critic = build_gpt_model(tiny_arch(vocab_size=VOCAB), "critic")
    micro = pack_rows(_batch(), [0, 1])
    with torch.no_grad():
        assert model_forward(critic, micro).shape == (1, micro["input_ids"].shape[1], 1)


def test_logit_positions_out_of_range_are_refused(megatron_single):
    from megatron_ppo.data.batch import pack_rows
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.forward import model_forward
    from megatron_ppo.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")
    micro = pack_rows(_batch(), [0, 1])
    total = micro["input_ids"].numel()
    with pytest.raises(ValueError, match=rf"'logit_positions' must lie in \[0, {total}\)"):
        model_forward(model, {**micro, "logit_positions": micro["logit_positions"] + total})


# --------------------------------------------------------------------------------------- 2 ranks: TP2, TP2+SP, PP2
def _job_layout(rank, world, layout, tied):
    """At one layout: the same weights and micro-batches through both paths; log-probs, entropies and the
    gradients of a loss on both (every parameter, gathered to full shape) must agree."""
    from megatron_ppo import parallel
    from megatron_ppo.data.batch import pack_rows
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.models.schedule import forward_backward
    from megatron_ppo.models.training import wrap_ddp
    from megatron_ppo.testing.sharding import gather_full_state_dict
    from megatron_ppo.workers.losses import response_logprobs_entropy

    tp, pp, sp = {"tp2": (2, 1, False), "tp2sp": (2, 1, True), "pp2": (1, 2, False)}[layout]
    parallel.initialize(tp=tp, pp=pp, seed=13)
    try:
        model = build_gpt_model(tiny_arch(vocab_size=VOCAB, tie_word_embeddings=tied), "actor",
                                sequence_parallel=sp)
        ddp = wrap_ddp(model)
        batch = _batch()
        w = torch.randn(2, *batch.responses.shape, generator=torch.Generator().manual_seed(1))
        micros = [pack_rows(batch, rows, align=tp) for rows in ([0, 1, 2], [3, 4])]
        for m, rows in zip(micros, ([0, 1, 2], [3, 4])):
            m["w"] = w[:, rows] * m["response_mask"]

        def run(mbs):
            lengths = []

            def loss_fn(logits, micro):
                lengths.append(logits.shape[1])
                logp, ent = response_logprobs_entropy(logits, micro, VOCAB, TEMPERATURE)
                loss = (micro["w"][0] * logp + micro["w"][1] * ent).sum()
                return loss, {"logp": logp.detach(), "ent": ent.detach()}

            ddp.zero_grad_buffer()
            metrics = forward_backward([ddp], mbs, loss_fn)
            return metrics, gather_full_state_dict(model, grads=True), lengths

        got_m, got_g, got_len = run(micros)
        ref_m, ref_g, ref_len = run([_full(m) for m in micros])
        last = parallel.is_last_stage()
    finally:
        parallel.destroy(destroy_process_group=False)
    diffs = {}
    for i, (a, b) in enumerate(zip(got_m, ref_m)):
        for key in a:
            diffs[f"mb{i}.{key}"] = (a[key] - b[key]).abs().max().item()
    for name, g in got_g.items():
        diffs[f"grad.{name}"] = (g - ref_g[name]).abs().max().item() / max(ref_g[name].abs().max().item(), 1e-3)
    return {"last": last, "diffs": diffs, "n_grads": len(got_g),
            "selected": got_len == [m["logit_positions"].numel() for m in micros] if last else None,
            "full": ref_len == [m["input_ids"].shape[1] for m in micros] if last else None}


@pytest.mark.slow
@pytest.mark.parametrize("layout,tied", [("tp2", True), ("tp2sp", True), ("tp2sp", False), ("pp2", True),
                                         ("pp2", False)])
def test_layouts_at_response_positions_equal_the_full_path(dist_pool2, layout, tied):
    results = dist_pool2.run(_job_layout, layout, tied)
    assert any(r["last"] for r in results)
    for rank, r in enumerate(results):
        assert r["n_grads"] > 0
        if r["last"]:
            assert r["selected"] and r["full"], f"rank {rank}: the LM head did not run where expected"
        bad = {k: v for k, v in r["diffs"].items() if not v <= 2e-5}
        assert not bad, f"rank {rank} {layout} tied={tied}: differences above 2e-5: {bad}"
