"""Generation: KV cache == full recompute, rollout log-probs == teacher-forced recomputation, eos / length stops,
seeded determinism, top-k/top-p against transformers' warpers, greedy identical at TP1 / TP2 / TP2+SP / PP2."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.models.generation import SamplingParams, filter_logits

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
    from megatron_ppo.models.generation import generate

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
    from megatron_ppo.models.generation import generate

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
    from megatron_ppo.models.generation import generate

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
    from megatron_ppo.models.generation import generate

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


def _job_greedy_layouts(rank, world, layout):
    from megatron_ppo import parallel
    from megatron_ppo.models.generation import generate
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.testing.sharding import load_full_state_dict

    arch = tiny_arch(vocab_size=VOCAB, tie_word_embeddings=True)
    params = SamplingParams(max_response_length=14, greedy=True, temperature=0.9)
    parallel.initialize(seed=4)
    try:
        model = build_gpt_model(arch, "actor")
        full = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        ref = generate(model, _prompts(), params)
    finally:
        parallel.destroy(destroy_process_group=False)
    tp, pp, sp = {"tp2": (2, 1, False), "tp2sp": (2, 1, True), "pp2": (1, 2, False)}[layout]
    parallel.initialize(tp=tp, pp=pp, seed=9)
    try:
        model = build_gpt_model(arch, "actor", sequence_parallel=sp)
        load_full_state_dict(model, full)
        got = generate(model, _prompts(), params)
        sampled = generate(model, _prompts(), SamplingParams(max_response_length=8, temperature=1.2, seed=2))
        still_sp = model.config.sequence_parallel
    finally:
        parallel.destroy(destroy_process_group=False)
    return {"same_tokens": torch.equal(ref.responses, got.responses),
            "logp": (ref.log_probs - got.log_probs).abs().max().item(),
            "sampled": sampled.responses, "sp_restored": still_sp == sp}


@pytest.mark.slow  # two ranks
@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2"])
def test_greedy_identical_across_layouts(dist_pool2, layout):
    r0, r1 = dist_pool2.run(_job_greedy_layouts, layout)
    for r in (r0, r1):
        assert r["same_tokens"] and r["logp"] < 1e-5 and r["sp_restored"]
    assert torch.equal(r0["sampled"], r1["sampled"])  # every rank returns the sampler's tokens
