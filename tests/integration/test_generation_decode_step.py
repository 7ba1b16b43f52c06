"""The decode speed-ups are exact: keys RoPE-rotated once into the cache (``CachedRopeSelfAttention``) and the lean
one-token step (``rollout.decode_step``) on the modules' own linears give bit-identical tokens and log-probs to
megatron's own path (megatron's ``SelfAttention``, which caches un-rotated keys and re-rotates the cache every step,
through ``GPTModel.forward``), for Llama- and Qwen2-style (qkv bias) and GELU-MHA models, tied and untied, ragged and
aligned prefill, greedy and sampled, rows leaving at eos; at TP2 / TP2+SP / PP2 too. With oneDNN-prepacked GEMM
weights (the CPU fp32 default) the same greedy tokens and log-probs to fp32 rounding (1e-5). A model the lean step
does not cover falls back by name; one the packing does not cover (bf16) uses the modules' linears."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.models.attention import CachedRopeSelfAttention
from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams, generate

VOCAB = 500
ARCHS = {"llama": {}, "llama_tied": {"tie_word_embeddings": True},
         "qwen2": {"add_qkv_bias": True, "tie_word_embeddings": True}, "gelu_mha": {"activation": "gelu",
                                                                                   "num_query_groups": 4}}


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 11, 3, 7, 7)]


@contextlib.contextmanager
def megatron_self_attention(model):
    """megatron's own SelfAttention in place of ours (what megatron caches: un-rotated keys)."""
    mods = [m for m in model.modules() if type(m) is CachedRopeSelfAttention]
    for m in mods:
        m.__class__ = SelfAttention
    try:
        yield
    finally:
        for m in mods:
            m.__class__ = CachedRopeSelfAttention


def _random_biases(model):
    """megatron initialises biases to zero, which would hide a dropped bias: draw them (same on every rank)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_((0.5 * torch.randn(p.shape, generator=g)).to(p.dtype))
    return model


def _three_ways(model, prompts, params, options):
    """(lean step on the modules' linears + rotated cache, megatron forward + rotated cache, megatron's own path),
    all three on torch's GEMMs (neither prepacked decode weights nor oneDNN prefill)."""
    options = dataclasses.replace(options, packed_linears=False, onednn_prefill=False)
    lean = generate(model, prompts, params, options)
    full = generate(model, prompts, params, dataclasses.replace(options, lean_decode=False))
    with megatron_self_attention(model):
        megatron = generate(model, prompts, params, dataclasses.replace(options, lean_decode=False))
    return lean, full, megatron


def _assert_close(a, b, atol=1e-5):
    """oneDNN's GEMM sums in another order than MKL's: same greedy tokens, log-probs to fp32 rounding."""
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=atol, rtol=0)
    assert torch.equal(a.response_lengths, b.response_lengths) and torch.equal(a.finished, b.finished)


def _assert_identical(a, b):
    assert torch.equal(a.responses, b.responses)
    assert torch.equal(a.log_probs, b.log_probs)  # bit for bit, not to a tolerance
    assert torch.equal(a.response_lengths, b.response_lengths) and torch.equal(a.finished, b.finished)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("prefill", ["ragged", "aligned"])
def test_lean_step_and_rotated_cache_are_bit_identical_to_megatron(megatron_single, arch, prefill, monkeypatch):
    from megatron_ppo.rollout import decode_step
    from megatron_ppo.rollout.decode_step import unsupported_reason
    from megatron_ppo.models.gpt import build_gpt_model

    model = _random_biases(build_gpt_model(tiny_arch(vocab_size=VOCAB, **ARCHS[arch]), "actor"))
    assert unsupported_reason(model) is None  # the lean step really runs
    sampled = SamplingParams(max_response_length=12, temperature=0.8, seed=5)
    opts = DecodeOptions(prefill=prefill)
    lean, full, megatron = _three_ways(model, _prompts(), sampled, opts)
    _assert_identical(lean, full)
    _assert_identical(lean, megatron)
    greedy = generate(model, _prompts(), dataclasses.replace(sampled, greedy=True), opts)
    eos = (int(greedy.responses[1, 2]), int(greedy.responses[3, 5]))  # rows stop early and leave the batch
    stop = dataclasses.replace(sampled, eos_token_ids=eos, greedy=True)
    lean, full, megatron = _three_ways(model, _prompts(), stop, opts)
    assert bool(lean.finished.any())
    _assert_identical(lean, full)
    _assert_identical(lean, megatron)
    # the default, oneDNN-prepacked GEMM weights (greedy: rounding cannot flip a sample)
    packed_calls = []
    real_call = decode_step._PackedLinear.__call__
    monkeypatch.setattr(decode_step._PackedLinear, "__call__",
                        lambda self, x: packed_calls.append(1) or real_call(self, x))  # counts, then runs it
    greedy = generate(model, _prompts(), dataclasses.replace(sampled, greedy=True), opts)
    assert len(packed_calls) >= 11 * (4 * 2 + 1)  # 11 decode steps x (2 layers x 4 linears + output layer)
    with megatron_self_attention(model):
        greedy_megatron = generate(model, _prompts(), dataclasses.replace(sampled, greedy=True),
                                   dataclasses.replace(opts, lean_decode=False))
    _assert_close(greedy, greedy_megatron)


def test_packing_falls_back_to_the_modules_where_it_does_not_apply(megatron_single):
    from megatron_ppo.rollout.decode_step import DecodeStep, onednn_packable
    from megatron_ppo.models.gpt import build_gpt_model

    fp32 = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")
    bf16 = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor", params_dtype=torch.bfloat16)
    assert onednn_packable(fp32) and not onednn_packable(bf16)
    assert DecodeStep(fp32, 32, 4).linears is not None and DecodeStep(bf16, 32, 4).linears is None
    params = SamplingParams(max_response_length=6, greedy=True)
    _assert_identical(generate(bf16, _prompts(), params),
                      generate(bf16, _prompts(), params, DecodeOptions(packed_linears=False)))


def test_rotated_cache_holds_megatron_rotation_of_each_key(megatron_single):
    """The cache holds apply_rotary_pos_emb(key, freqs[position]) for every written column."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_ppo.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor").eval()
    ids = torch.randint(0, VOCAB, (2, 6))
    captured = {}
    att = model.decoder.layers[1].self_attention
    hook = att.linear_qkv.register_forward_hook(lambda m, i, o: captured.update(x=i[0]) or None)
    ctx = StaticInferenceContext(2, 16)
    with torch.no_grad():
        model(ids, None, None, inference_context=ctx, runtime_gather_output=True)
    hook.remove()
    with torch.no_grad():
        _, key, _ = att.get_query_key_value_tensors(captured["x"], None)
        freqs = model.rotary_pos_emb(16)[:6]
        want = apply_rotary_pos_emb(key, freqs, config=model.config)
    cached = ctx.key_value_memory_dict[att.layer_number][0][:6]
    assert torch.equal(cached, want)
    assert not torch.allclose(cached, key)  # megatron's SelfAttention would have cached the un-rotated key


def test_a_model_the_lean_step_does_not_cover_falls_back(megatron_single):
    from megatron_ppo.rollout.decode_step import unsupported_reason
    from megatron_ppo.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")
    params = SamplingParams(max_response_length=6, greedy=True)
    want = generate(model, _prompts(), params)
    with megatron_self_attention(model):
        assert "self_attention SelfAttention" in unsupported_reason(model)
        got = generate(model, _prompts(), params)  # megatron's forward, not the lean step (which would be wrong)
    _assert_identical(want, got)


def _job_layouts(rank, world, layout):
    from megatron_ppo import parallel
    from megatron_ppo.models.gpt import build_gpt_model

    tp, pp, sp = {"tp2": (2, 1, False), "tp2sp": (2, 1, True), "pp2": (1, 2, False)}[layout]
    parallel.initialize(tp=tp, pp=pp, seed=7)
    try:
        model = _random_biases(build_gpt_model(tiny_arch(vocab_size=VOCAB, add_qkv_bias=True), "actor",
                                               sequence_parallel=sp))
        params = SamplingParams(max_response_length=10, temperature=0.9, seed=3)
        lean, full, megatron = _three_ways(model, _prompts(), params, DecodeOptions())
        greedy = dataclasses.replace(params, greedy=True)
        packed = generate(model, _prompts(), greedy)
        with megatron_self_attention(model):
            packed_ref = generate(model, _prompts(), greedy, DecodeOptions(lean_decode=False))
    finally:
        parallel.destroy(destroy_process_group=False)
    same = all(torch.equal(lean.responses, x.responses) and torch.equal(lean.log_probs, x.log_probs)
               for x in (full, megatron))
    close = torch.equal(packed.responses, packed_ref.responses) and float(
        (packed.log_probs - packed_ref.log_probs).abs().max()) < 1e-5
    return {"same": same, "close": close, "tokens": lean.responses, "packed": packed.responses}


@pytest.mark.slow  # two ranks
@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2"])
def test_lean_step_is_bit_identical_on_two_ranks(dist_pool2, layout):
    r0, r1 = dist_pool2.run(_job_layouts, layout)
    assert r0["same"] and r1["same"]
    assert r0["close"] and r1["close"]  # oneDNN-packed GEMMs with megatron's TP collectives
    assert torch.equal(r0["tokens"], r1["tokens"]) and torch.equal(r0["packed"], r1["packed"])
