"""The static decode step has no data-dependent Python control flow: ``torch.compile(fullgraph=True)`` (which raises
on any graph break, where a CUDA graph capture would fail or read the host) compiles it, and a rollout with
``rollout.megatron.use_torch_compile`` gives the eager loop's tokens and log-probs (greedy with rows stopping at
eos and leaving the batch at a bucket, and seeded sampling)."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams

VOCAB = 500


@pytest.fixture
def actor(megatron_single):
    from megatron_ppo.models.gpt import build_gpt_model

    return build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")


@pytest.mark.slow  # ~1 min: dynamo compiles the decode step (once per batch bucket)
def test_static_step_compiles_as_one_graph_and_equals_eager(actor):
    import torch._dynamo

    from megatron_ppo.rollout import generation
    from megatron_ppo.rollout.decode_step import StaticKVCache, StaticStep
    from megatron_ppo.rollout.static_loop import compile_decode

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    # the step alone, fullgraph: a graph break (a host read, a branch on a tensor) raises here
    cache = StaticKVCache(actor, 4, 16, torch.float32, torch.device("cpu"))
    step = StaticStep(actor, 16, 4, packed=False)
    compiled = compile_decode(step)  # torch.compile(step.decode, fullgraph=True)
    ids = torch.randint(0, VOCAB, (4, 1))
    pos, first_col = torch.tensor([5]), torch.tensor([0, 2, 5, 1])
    got = compiled(ids, pos, first_col, cache)
    eager_cache = StaticKVCache(actor, 4, 16, torch.float32, torch.device("cpu"))
    want = step.decode(ids, pos, first_col, eager_cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for (k, v), (ek, ev) in zip(cache.mem.values(), eager_cache.mem.values()):
        torch.testing.assert_close(k[:, :, 5], ek[:, :, 5], atol=1e-5, rtol=0)  # the compiled step's cache write
        assert bool(k[:, :, 5].abs().sum() > 0) and not bool(k[:, :, 6].abs().sum() > 0)
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 9, 3, 6)]
    greedy = generation.generate(actor, prompts, SamplingParams(max_response_length=10, greedy=True))
    eos = (int(greedy.responses[1, 3]),)
    stopped = []
    for base in (SamplingParams(max_response_length=10, greedy=True, eos_token_ids=eos),
                 SamplingParams(max_response_length=10, temperature=0.8, top_k=40, seed=3)):
        options = DecodeOptions(alive_check_interval=4, batch_buckets=(2,))
        eager = generation.generate(actor, prompts, base, options)
        compiled = generation.generate(actor, prompts, base, DecodeOptions(
            alive_check_interval=4, batch_buckets=(2,), compile_decode=True))
        for name in ("responses", "response_lengths", "finished"):
            assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
        torch.testing.assert_close(compiled.log_probs, eager.log_probs, atol=1e-5, rtol=0)
        stopped.append(bool(eager.finished.any()))
    assert stopped[0], "the greedy case should stop a row at eos (rows leave the compiled decode batch)"
