"""The static decode loop (rollout.static_loop, rollout.decode_step) gives megatron's tokens and log-probs: against
``GPTModel.forward`` with megatron's own ``SelfAttention`` (un-rotated cache, re-rotated every step) and against our
cached-RoPE attention, for Llama- and Qwen2-style (qkv bias, tied) and GELU-MHA models, greedy and sampled, rows
finishing at different steps; with megatron's local core attention in place of ours (the step does not use the
spec's core attention, as with Transformer Engine's); at TP2 / TP2+SP / PP2 (micro-batches through the stages). The static step attends over the whole
static cache (masked columns weigh exactly 0), so log-probs agree to fp32 rounding, not bit for bit.

It reads nothing back to the host inside the decode step, at most once per ``alive_check_interval`` steps in the
loop; finished rows leave the batch only at bucket sizes; a model it does not cover falls back by name."""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.models.attention import CachedRopeSelfAttention
from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams, generate

VOCAB = 500
ARCHS = {"llama": {}, "llama_tied": {"tie_word_embeddings": True},
         "qwen2": {"add_qkv_bias": True, "tie_word_embeddings": True}, "gelu_mha": {"activation": "gelu",
                                                                                   "num_query_groups": 4}}
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero")


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


def _static_and_megatron(model, prompts, params, options=DecodeOptions()):
    """(the static loop on the modules' linears, megatron's forward with megatron's SelfAttention)."""
    options = dataclasses.replace(options, packed_linears=False, onednn_prefill=False)
    static = generate(model, prompts, params, options)
    with megatron_self_attention(model):
        megatron = generate(model, prompts, params, dataclasses.replace(options, static_step=False))
    return static, megatron


def _assert_close(a, b, atol=1e-5):
    """Same tokens, lengths and ends; log-probs to fp32 rounding."""
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=atol, rtol=0)
    assert torch.equal(a.response_lengths, b.response_lengths) and torch.equal(a.finished, b.finished)


def _eos_params(model, sampled):
    """Greedy with two eos ids taken from a greedy run, so rows stop at different steps."""
    greedy = generate(model, _prompts(), dataclasses.replace(sampled, greedy=True))
    eos = (int(greedy.responses[1, 2]), int(greedy.responses[3, 5]))
    return dataclasses.replace(sampled, eos_token_ids=eos, greedy=True)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_static_loop_equals_megatron(megatron_single, arch, monkeypatch):
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout import decode_step
    from megatron_ppo.rollout.decode_step import unsupported_reason

    model = _random_biases(build_gpt_model(tiny_arch(vocab_size=VOCAB, **ARCHS[arch]), "actor"))
    assert unsupported_reason(model) is None  # the static step really runs
    sampled = SamplingParams(max_response_length=12, temperature=0.8, seed=5)
    _assert_close(*_static_and_megatron(model, _prompts(), sampled))
    stop = _eos_params(model, sampled)
    static, megatron = _static_and_megatron(model, _prompts(), stop, DecodeOptions(alive_check_interval=1))
    assert bool(static.finished.any())
    _assert_close(static, megatron)
    # the default, oneDNN-prepacked GEMM weights (greedy: rounding cannot flip a sample)
    packed_calls = []
    real_call = decode_step._Linear.__call__
    monkeypatch.setattr(decode_step._Linear, "__call__",  # counts the prepacked calls, then runs it
                        lambda self, x: packed_calls.append(self.packed is not None) or real_call(self, x))
    greedy = generate(model, _prompts(), dataclasses.replace(sampled, greedy=True))
    assert sum(packed_calls) >= 11 * (4 * 2 + 1)  # 11 decode steps x (2 layers x 4 linears + output layer)
    with megatron_self_attention(model):
        greedy_megatron = generate(model, _prompts(), dataclasses.replace(sampled, greedy=True),
                                   DecodeOptions(static_step=False))
    _assert_close(greedy, greedy_megatron)


def test_static_step_does_not_use_the_specs_core_attention(megatron_single):
    """megatron's local DotProductAttention as the core attention (it takes no arbitrary mask, like TE's): the
    static step covers the model all the same and its tokens and log-probs do not change."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_ppo.models.attention import SDPACoreAttention
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout.decode_step import unsupported_reason

    model = _random_biases(build_gpt_model(tiny_arch(vocab_size=VOCAB, add_qkv_bias=True), "actor"))
    params = SamplingParams(max_response_length=10, temperature=0.7, seed=2)
    ours = generate(model, _prompts(), params)
    for layer in model.decoder.layers:
        old = layer.self_attention.core_attention
        assert type(old) is SDPACoreAttention
        layer.self_attention.core_attention = DotProductAttention(
            model.config, old.layer_number, old.attn_mask_type, "self",
            pg_collection=layer.self_attention.pg_collection)
    assert unsupported_reason(model) is None
    theirs = generate(model, _prompts(), params)
    assert torch.equal(ours.responses, theirs.responses) and torch.equal(ours.log_probs, theirs.log_probs)


def test_packing_falls_back_to_plain_gemms_where_it_does_not_apply(megatron_single):
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout.decode_step import StaticStep, onednn_packable

    fp32 = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")
    bf16 = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor", params_dtype=torch.bfloat16)
    assert onednn_packable(fp32) and not onednn_packable(bf16)
    assert StaticStep(fp32, 32, 4).packed and not StaticStep(bf16, 32, 4).packed
    assert not StaticStep(fp32, 32, 4, packed=False).packed
    params = SamplingParams(max_response_length=6, greedy=True)
    a = generate(bf16, _prompts(), params)
    b = generate(bf16, _prompts(), params, DecodeOptions(packed_linears=False))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.log_probs, b.log_probs)


def test_rotated_cache_holds_megatron_rotation_of_each_key(megatron_single):
    """megatron's forward path (the fallback): the cache holds apply_rotary_pos_emb(key, freqs[position])."""
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


class _OtherMLP(MLP):
    """An MLP the static step does not know (it checks the type, as it would for a MoE layer)."""


def test_a_model_the_static_step_does_not_cover_falls_back_by_name(megatron_single, caplog, monkeypatch):
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout import generation, static_loop

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")
    model.decoder.layers[1].mlp.__class__ = _OtherMLP
    monkeypatch.setattr(generation, "_WARNED", set())
    used = []
    real = static_loop.generate_static
    monkeypatch.setattr(static_loop, "generate_static", lambda *a: used.append(1) or real(*a))
    params = SamplingParams(max_response_length=6, greedy=True)
    with caplog.at_level(logging.WARNING, logger="megatron_ppo.rollout.generation"):
        got = generate(model, _prompts(), params)
        generate(model, _prompts(), params)
    warnings = [r.getMessage() for r in caplog.records if "static decode step" in r.getMessage()]
    assert len(warnings) == 1 and "mlp _OtherMLP" in warnings[0], warnings  # one line, naming the reason
    assert not used
    want = generate(model, _prompts(), params, DecodeOptions(static_step=False))
    assert torch.equal(got.responses, want.responses) and torch.equal(got.log_probs, want.log_probs)
    bad = _prompts()
    bad[3] = torch.tensor([1, VOCAB])
    with pytest.raises(ValueError, match=r"prompt 3 has token ids outside \[0, 500\)"):
        generate(model, bad, params)


def _host_reads(prof, inside: str) -> int:
    """Host reads (an op that waits for the device's value) under the profiler range ``inside``; an op nested in
    another host read (``item`` -> ``_local_scalar_dense``) counts once."""
    n = 0
    for e in prof.events():
        if e.name not in HOST_READS:
            continue
        chain, p = [], e.cpu_parent
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        if inside in chain and not any(c in HOST_READS for c in chain):
            n += 1
    return n


def test_decode_step_reads_nothing_back_and_the_loop_once_per_interval(megatron_single):
    """The brief's goal: 0 host reads inside the decode step, at most one per alive_check_interval (8) steps in the
    loop. megatron's forward path read in every layer at every step (the attention's empty-row check) until issue 47
    took that read out: none there either now."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_ppo.models.gpt import build_gpt_model

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB, num_layers=4), "actor")
    params = SamplingParams(max_response_length=33, temperature=1.0, seed=1)  # 32 decode steps, nobody stops
    counts = {}
    for name, opts in {"static": DecodeOptions(), "megatron": DecodeOptions(static_step=False)}.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(model, _prompts(), params, opts)
        counts[name] = (_host_reads(prof, "generate/decode_forward"), _host_reads(prof, "generate/decode_loop"))
    assert counts["static"][0] == 0 and 1 <= counts["static"][1] <= 32 // 8, counts
    assert counts["megatron"][0] == 0, counts  # (its loop has no range of its own)


def test_rows_leave_at_bucket_sizes_and_a_row_cap_and_results_do_not_change(megatron_single, monkeypatch):
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout.decode_step import StaticKVCache

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in torch.randint(2, 12, (12,), generator=g)]
    base = SamplingParams(max_response_length=24, temperature=1.0, seed=4)
    free = generate(model, prompts, base)
    eos = tuple(sorted({int(t) for t in free.responses[:, 3:6].flatten()})[:6])  # several rows stop early
    params = dataclasses.replace(base, eos_token_ids=eos)
    sizes = []
    real = StaticKVCache.keep_rows
    monkeypatch.setattr(StaticKVCache, "keep_rows", lambda self, keep: sizes.append(keep.numel()) or real(self, keep))
    compacted = generate(model, prompts, params, DecodeOptions(alive_check_interval=1))
    assert sizes and all(s in (8, 4, 2, 1) for s in sizes) and sizes == sorted(sizes, reverse=True), sizes
    configured = []
    monkeypatch.setattr(StaticKVCache, "keep_rows",
                        lambda self, keep: configured.append(keep.numel()) or real(self, keep))
    in_sixes = generate(model, prompts, params, DecodeOptions(alive_check_interval=3, batch_buckets=(6, 3)))
    assert set(configured) <= {6, 3}, configured
    sizes.clear()
    kept = generate(model, prompts, params, DecodeOptions(drop_finished=False))
    assert not sizes
    assert bool(kept.finished.any()) and not bool(kept.finished.all())
    # at most 5 rows decoded at once (three turns of rows, longest prompts first): the same samples
    batches = []
    real_init = StaticKVCache.__init__
    monkeypatch.setattr(StaticKVCache, "__init__", lambda self, core, batch, *a: batches.append(batch) or real_init(
        self, core, batch, *a))
    capped = generate(model, prompts, params, DecodeOptions(drop_finished=False, max_num_seqs=5))
    assert batches == [5, 5, 2], batches
    for other in (compacted, in_sixes, capped):
        assert torch.equal(other.responses, kept.responses)
        assert torch.equal(other.response_lengths, kept.response_lengths)
        torch.testing.assert_close(other.log_probs, kept.log_probs, atol=1e-5, rtol=0)


def test_prefill_keeps_a_fused_attention_kernel_and_its_token_budget(megatron_single, monkeypatch):
    """GQA prefill with a mask: SDPA's fused CPU kernel, never its math backend (an fp32 [B, H, s, s] matrix on a
    GPU); a forward holds at most prefill_token_budget tokens; the budget changes no result."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.rollout.static_loop import StaticRunner

    model = build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")  # GQA 4 / 2
    params = SamplingParams(max_response_length=4, greedy=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        whole = generate(model, _prompts(), params)
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    widths = []
    real = StaticRunner.prefill
    monkeypatch.setattr(StaticRunner, "prefill",
                        lambda self, ids, *a: widths.append(ids.numel()) or real(self, ids, *a))
    small = generate(model, _prompts(), params, DecodeOptions(prefill_token_budget=12))
    assert widths and max(widths) <= 12 and len(widths) >= 3, widths
    assert torch.equal(small.responses, whole.responses)
    torch.testing.assert_close(small.log_probs, whole.log_probs, atol=1e-5, rtol=0)


def _job_layouts(rank, world, layout):
    from megatron_ppo import parallel
    from megatron_ppo.models.gpt import build_gpt_model

    tp, pp, sp = {"tp2": (2, 1, False), "tp2sp": (2, 1, True), "pp2": (1, 2, False)}[layout]
    from megatron_ppo.rollout import static_loop

    parallel.initialize(tp=tp, pp=pp, seed=7)
    pipelined = []
    real_pipelined = static_loop.decode_pipelined
    static_loop.decode_pipelined = lambda *a: pipelined.append(1) or real_pipelined(*a)
    try:
        model = _random_biases(build_gpt_model(tiny_arch(vocab_size=VOCAB, add_qkv_bias=True), "actor",
                                               sequence_parallel=sp))
        params = SamplingParams(max_response_length=10, temperature=0.9, seed=3)
        static, megatron = _static_and_megatron(model, _prompts(), params)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate(model, _prompts(), params)
        step_reads = _host_reads(prof, "generate/decode_forward")  # TP's embedding masks, collectives: none either
        stop = _eos_params(model, params)
        packed = generate(model, _prompts(), stop, DecodeOptions(alive_check_interval=1))
        with megatron_self_attention(model):
            packed_ref = generate(model, _prompts(), stop, DecodeOptions(static_step=False))
        every_token_ends = dataclasses.replace(stop, eos_token_ids=tuple(range(VOCAB)))  # all rows end at step 0
        ended = generate(model, _prompts(), every_token_ends, DecodeOptions(alive_check_interval=1, max_num_seqs=3))
    finally:
        static_loop.decode_pipelined = real_pipelined
        parallel.destroy(destroy_process_group=False)

    def close(a, b):
        return torch.equal(a.responses, b.responses) and float((a.log_probs - b.log_probs).abs().max()) < 1e-5

    return {"close": close(static, megatron), "packed_close": close(packed, packed_ref), "step_reads": step_reads,
            "stopped": bool(packed.finished.any()), "tokens": static.responses, "packed": packed.responses,
            "pipelined": len(pipelined), "ended": ended.response_lengths.tolist()}


@pytest.mark.slow  # two ranks
@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "pp2"])
def test_static_loop_equals_megatron_on_two_ranks(dist_pool2, layout):
    r0, r1 = dist_pool2.run(_job_layouts, layout)
    assert r0["close"] and r1["close"]
    assert r0["step_reads"] == 0 and r1["step_reads"] == 0, (r0["step_reads"], r1["step_reads"])
    assert r0["packed_close"] and r1["packed_close"] and r0["stopped"]  # oneDNN GEMMs, TP collectives, rows leaving
    assert torch.equal(r0["tokens"], r1["tokens"]) and torch.equal(r0["packed"], r1["packed"])
    assert r0["ended"] == r1["ended"] == [1] * 5  # the stop reaches every stage (PP: the broadcast count)
    # PP2: the rows flow through the stages as micro-batches (4 static rollouts, one more in two 3-row turns)
    assert r0["pipelined"] == r1["pipelined"] == (6 if layout == "pp2" else 0), (r0["pipelined"], r1["pipelined"])
