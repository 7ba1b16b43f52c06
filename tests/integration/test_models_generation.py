"""Generation: KV cache == full recompute, rollout log-probs == teacher-forced recomputation, eos / length stops,
seeded determinism, top-k/top-p against transformers' warpers, greedy identical at TP1 / TP2 / TP2+SP / PP2;
ragged prefill (one forward for all prompts) == the aligned loop; dropping finished rows changes no result."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams, filter_logits

VOCAB = 500


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 9, 3, 6)]


def _teacher_forced(model, prompts, out, temperature):
    from megatron_ppo.models.logprobs import vocab_parallel_logprobs_entropy

    diffs = []
    for i, p in enumerate(prompts):
        n = int(out.response_lengths[i])
        seq = torch.cat([p, out.responses[i, :n]])
        logits = model(seq.unsqueeze(0), None, None)[0, len(p) - 1:len(p) - 1 + n]
        lp, _ = vocab_parallel_logprobs_entropy(logits, seq[len(p):], vocab_size=VOCAB, temperature=temperature)
        diffs.append((lp - out.log_probs[i, :n]).abs().max().item())
    return max(diffs)


@pytest.fixture
def actor(megatron_single):
    from megatron_ppo.models.gpt import build_gpt_model

    return build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")


def test_kv_cache_equals_recompute_and_logprobs_equal_teacher_forcing(actor):
    from megatron_ppo.rollout.generation import generate

    prompts = _prompts()
    for params in (SamplingParams(max_response_length=12, greedy=True),
                   SamplingParams(max_response_length=12, temperature=0.7, top_k=40, top_p=0.9, seed=5)):
        cached = generate(actor, prompts, params, use_kv_cache=True)
        full = generate(actor, prompts, params, use_kv_cache=False)
        assert torch.equal(cached.responses, full.responses)
        torch.testing.assert_close(cached.log_probs, full.log_probs, atol=1e-5, rtol=0)
        assert cached.response_lengths.tolist() == [12] * 4 and not cached.finished.any()
        assert _teacher_forced(actor, prompts, cached, params.temperature) < 1e-5
        assert (cached.log_probs < 0).all()


def test_eos_stops_a_row_and_pads_the_rest(actor):
    from megatron_ppo.rollout.generation import generate

    prompts = _prompts()
    base = generate(actor, prompts, SamplingParams(max_response_length=10, greedy=True))
    eos = int(base.responses[1, 3])
    first = int((base.responses[1] == eos).nonzero()[0])
    out = generate(actor, prompts, SamplingParams(max_response_length=10, greedy=True, eos_token_ids=(eos,),
                                                  pad_token_id=VOCAB - 1))
    assert out.finished[1] and int(out.response_lengths[1]) == first + 1
    assert int(out.responses[1, first]) == eos
    assert (out.responses[1, first + 1:] == VOCAB - 1).all() and (out.log_probs[1, first + 1:] == 0).all()
    assert out.response_mask()[1].sum() == first + 1
    for i in range(4):  # rows stop at their own first eos (or the length limit); before it they are unchanged
        n = int(out.response_lengths[i])
        assert torch.equal(out.responses[i, :n], base.responses[i, :n])


def test_seeded_sampling_is_deterministic_and_top_k1_is_greedy(actor):
    from megatron_ppo.rollout.generation import generate

    prompts = _prompts()
    p = SamplingParams(max_response_length=16, temperature=1.3, seed=11)
    a, b = generate(actor, prompts, p), generate(actor, prompts, p)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.log_probs, b.log_probs)
    c = generate(actor, prompts, SamplingParams(max_response_length=16, temperature=1.3, seed=12))
    assert not torch.equal(a.responses, c.responses)
    greedy = generate(actor, prompts, SamplingParams(max_response_length=16, greedy=True))
    top1 = generate(actor, prompts, SamplingParams(max_response_length=16, top_k=1, seed=3))
    assert torch.equal(greedy.responses, top1.responses)


def test_bad_inputs_are_named(actor):
    from megatron_ppo.rollout.generation import generate

    with pytest.raises(ValueError, match="prompt 1"):
        generate(actor, [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], SamplingParams(max_response_length=2))
    with pytest.raises(ValueError, match="outside"):
        generate(actor, [torch.tensor([1, VOCAB])], SamplingParams(max_response_length=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_response_length=2, top_p=0.0)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (7, 1.0), (20, 0.5), (0, 1.0)])
def test_filter_logits_matches_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(top_k + int(10 * top_p)))
    ref = logits.clone()
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ours = filter_logits(logits, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    torch.testing.assert_close(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])


def _forward_batches(model):
    """Record the [B, s] shape of every forward of ``model`` (a real forward pre-hook on its embedding)."""
    from megatron_ppo.testing.forwards import record_forward_shapes

    return record_forward_shapes(model)


def test_ragged_prefill_equals_aligned_loop_in_one_prefill_forward(actor):
    from megatron_ppo.rollout.generation import generate

    prompts = _prompts()  # lengths 5, 9, 3, 6
    eos = int(generate(actor, prompts, SamplingParams(max_response_length=10, greedy=True)).responses[2, 4])
    for base in (SamplingParams(max_response_length=10, greedy=True),
                 SamplingParams(max_response_length=10, greedy=True, temperature=0.8, eos_token_ids=(eos,),
                                pad_token_id=VOCAB - 1)):
        shapes, handle = _forward_batches(actor)
        try:
            ragged = generate(actor, prompts, base, DecodeOptions(prefill="ragged"))
            n_ragged = len(shapes)
            shapes.clear()
            aligned = generate(actor, prompts, base, DecodeOptions(prefill="aligned"))
            n_aligned = len(shapes)
        finally:
            handle.remove()
        assert torch.equal(ragged.responses, aligned.responses)
        assert torch.equal(ragged.response_lengths, aligned.response_lengths)
        assert torch.equal(ragged.finished, aligned.finished)
        torch.testing.assert_close(ragged.log_probs, aligned.log_probs, atol=1e-5, rtol=0)
        assert _teacher_forced(actor, prompts, ragged, base.temperature) < 1e-5
        # one prefill of all prompts + one forward per further response token, vs (9 - 3) + 10 for the aligned loop
        assert n_ragged <= 10 and n_aligned == 9 - 3 + 10, (n_ragged, n_aligned)
    assert ragged.finished.any() and not ragged.finished.all()  # the eos case really stopped some rows early


def test_prefill_groups_minimise_padded_tokens_plus_forwards():
    from megatron_ppo.rollout.generation import prefill_groups

    assert prefill_groups([9, 6, 5, 3], 32) == [(0, 4)]  # padding is cheaper than another forward
    assert prefill_groups([9, 6, 5, 3], 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert prefill_groups([100, 98, 20, 19, 18], 32) == [(0, 2), (2, 5)]
    with pytest.raises(ValueError, match="descending"):
        prefill_groups([3, 9], 1)


def test_grouped_prefill_of_far_apart_lengths_equals_aligned_loop(actor):
    from megatron_ppo.rollout.generation import generate

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (4, 90, 7, 88, 50, 5)]
    shapes, handle = _forward_batches(actor)
    try:
        ragged = generate(actor, prompts, SamplingParams(max_response_length=6, greedy=True),
                          DecodeOptions(prefill="ragged"))
    finally:
        handle.remove()
    prefill = shapes[:-5]  # the last 5 forwards decode response tokens 2..6
    assert len(prefill) >= 2 and sum(b for b, _ in prefill) == len(prompts), shapes  # >1 group, each row once
    assert sum(b * s for b, s in prefill) < len(prompts) * 90  # fewer than the left-padded batch's tokens
    aligned = generate(actor, prompts, SamplingParams(max_response_length=6, greedy=True),
                       DecodeOptions(prefill="aligned"))
    assert torch.equal(ragged.responses, aligned.responses)
    torch.testing.assert_close(ragged.log_probs, aligned.log_probs, atol=1e-5, rtol=0)
    assert _teacher_forced(actor, prompts, ragged, 1.0) < 1e-5


def test_dropping_finished_rows_changes_no_result(actor):
    """megatron's forward loop (the fallback) drops finished rows every step; the static loop at bucket sizes
    (test_generation_static_step.py)."""
    from megatron_ppo.rollout.generation import generate

    prompts = _prompts()
    probe = generate(actor, prompts, SamplingParams(max_response_length=12, temperature=1.5, seed=7))
    greedy = generate(actor, prompts, SamplingParams(max_response_length=12, greedy=True))
    eos = (int(probe.responses[0, 2]), int(probe.responses[3, 5]), int(greedy.responses[1, 4]))
    stopped = []
    for base in (SamplingParams(max_response_length=12, temperature=1.5, seed=7, eos_token_ids=eos),
                 SamplingParams(max_response_length=12, greedy=True, eos_token_ids=eos),
                 SamplingParams(max_response_length=12, temperature=0.9, top_k=30, top_p=0.8, seed=3,
                                eos_token_ids=eos)):
        shapes, handle = _forward_batches(actor)
        try:
            dropped = generate(actor, prompts, base, DecodeOptions(static_step=False, drop_finished=True))
            batches = [s[0] for s in shapes]
            kept = generate(actor, prompts, base, DecodeOptions(static_step=False, drop_finished=False))
        finally:
            handle.remove()
        for name in ("responses", "response_lengths", "finished"):
            assert torch.equal(getattr(dropped, name), getattr(kept, name)), name
        torch.testing.assert_close(dropped.log_probs, kept.log_probs, atol=1e-6, rtol=0)
        if dropped.finished.any():  # rows that finished early really left the decode batch
            assert min(batches) < 4 and batches == sorted(batches, reverse=True), batches
        stopped.append(bool(dropped.finished.any()))
    assert stopped[0] and stopped[1], stopped  # the seeded and the greedy case both stop rows early


def test_prefill_mode_is_checked(actor):
    from megatron_ppo.rollout.generation import resolve_prefill

    assert resolve_prefill(actor, "auto") == "ragged"  # the local spec's SDPACoreAttention takes masks
    assert resolve_prefill(actor, "aligned") == "aligned"
    with pytest.raises(ValueError, match="prefill"):
        DecodeOptions(prefill="left")


def test_inverse_cdf_sampler_never_draws_a_zero_and_follows_the_distribution():
    from megatron_ppo.rollout.generation import sample_from_probs

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    edges = torch.tensor([0.0, 0.5, 0.75, 1.0 - 2 ** -53, 1.0], dtype=torch.float64)  # 1.0: u*total rounding up
    for u in edges:
        tok = sample_from_probs(probs, u.expand(2))
        assert probs[torch.arange(2), tok].gt(0).all(), (u, tok)
    assert sample_from_probs(probs[:1], torch.tensor([0.0])).item() == 1  # first non-zero entry
    assert sample_from_probs(probs[:1], torch.tensor([0.5])).item() == 3  # cdf 0.5 at index 1 is not > 0.5
    g = torch.Generator().manual_seed(0)
    n = 40_000
    u = torch.rand(n, generator=g, dtype=torch.float64)
    counts = torch.bincount(sample_from_probs(probs[:1].expand(n, -1), u), minlength=6).double() / n
    torch.testing.assert_close(counts, probs[0].double(), atol=0.01, rtol=0)


def _job_greedy_layouts(rank, world, layout):
    from megatron_ppo import parallel
    from megatron_ppo.rollout.generation import generate
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.testing.sharding import load_full_state_dict

    arch = tiny_arch(vocab_size=VOCAB, tie_word_embeddings=True)
    params = SamplingParams(max_response_length=14, greedy=True, temperature=0.9)
    parallel.initialize(seed=4)
    try:
        model = build_gpt_model(arch, "actor")
        full = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        ref = generate(model, _prompts(), params)
        ref_aligned = generate(model, _prompts(), params, DecodeOptions(prefill="aligned"))
        eos = (int(ref.responses[0, 3]), int(ref.responses[2, 6]))
        stop = SamplingParams(**{**params.__dict__, "eos_token_ids": eos})
        ref_stop = generate(model, _prompts(), stop)
    finally:
        parallel.destroy(destroy_process_group=False)
    tp, pp, sp = {"tp2": (2, 1, False), "tp2sp": (2, 1, True), "pp2": (1, 2, False)}[layout]
    parallel.initialize(tp=tp, pp=pp, seed=9)
    try:
        model = build_gpt_model(arch, "actor", sequence_parallel=sp)
        load_full_state_dict(model, full)
        got = generate(model, _prompts(), params)
        got_aligned = generate(model, _prompts(), params, DecodeOptions(prefill="aligned"))
        got_stop = generate(model, _prompts(), stop)
        sampled = generate(model, _prompts(), SamplingParams(max_response_length=8, temperature=1.2, seed=2))
        still_sp = model.config.sequence_parallel
    finally:
        parallel.destroy(destroy_process_group=False)
    return {"same_tokens": all(torch.equal(ref.responses, x.responses) for x in (ref_aligned, got, got_aligned)),
            "logp": max((ref.log_probs - x.log_probs).abs().max().item() for x in (ref_aligned, got, got_aligned)),
            "stop_same": torch.equal(ref_stop.responses, got_stop.responses)
            and torch.equal(ref_stop.response_lengths, got_stop.response_lengths) and bool(got_stop.finished.any()),
            "stop_logp": (ref_stop.log_probs - got_stop.log_probs).abs().max().item(),
            "sampled": sampled.responses, "sp_restored": still_sp == sp}


@pytest.mark.slow  # two ranks
@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2"])
def test_greedy_identical_across_layouts(dist_pool2, layout):
    r0, r1 = dist_pool2.run(_job_greedy_layouts, layout)
    for r in (r0, r1):
        assert r["same_tokens"] and r["logp"] < 1e-5 and r["sp_restored"]
        assert r["stop_same"] and r["stop_logp"] < 1e-5  # rows leaving the batch at an eos, on every stage alike
    assert torch.equal(r0["sampled"], r1["sampled"])  # every rank returns the sampler's tokens
