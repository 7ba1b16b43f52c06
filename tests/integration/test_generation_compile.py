"""rollout.use_torch_compile (SamplingParams.compile_decode): the torch.compile'd decode step gives the eager loop's
tokens and log-probs (greedy and seeded, with rows finishing early and leaving the batch) and really runs compiled."""
from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.rollout.generation import SamplingParams

VOCAB = 500


@pytest.fixture
def actor(megatron_single):
    from megatron_ppo.models.gpt import build_gpt_model

    return build_gpt_model(tiny_arch(vocab_size=VOCAB), "actor")


@pytest.mark.slow  # ~1 min: dynamo compiles the decode step
@pytest.mark.parametrize("prefill", ["ragged", "aligned"])
def test_compiled_decode_equals_eager(actor, prefill):
    import torch._dynamo

    from megatron_ppo.rollout import generation

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 9, 3, 6)]
    greedy = generation.generate(actor, prompts, SamplingParams(max_response_length=10, greedy=True))
    eos = (int(greedy.responses[1, 3]),)
    torch._dynamo.reset()
    generation._COMPILED = None
    counters = torch._dynamo.utils.counters
    counters.clear()
    stopped = []
    options = generation.DecodeOptions(prefill=prefill)
    for base in (SamplingParams(max_response_length=10, greedy=True, eos_token_ids=eos),
                 SamplingParams(max_response_length=10, temperature=0.8, top_k=40, seed=3)):
        eager = generation.generate(actor, prompts, base, options)
        compiled = generation.generate(actor, prompts, base,
                                       generation.DecodeOptions(prefill=prefill, compile_decode=True))
        for name in ("responses", "response_lengths", "finished"):
            assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
        torch.testing.assert_close(compiled.log_probs, eager.log_probs, atol=1e-5, rtol=0)
        stopped.append(bool(eager.finished.any()))
    assert stopped[0], "the greedy case should stop a row at eos (rows leave the compiled decode batch)"
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # dynamo really compiled a graph
