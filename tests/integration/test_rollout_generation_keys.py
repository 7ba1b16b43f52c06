"""rollout.megatron.prefill / drop_finished / use_torch_compile (the Megatron engine's own section) reach the actor's
generation (rollout.megatron.build_engine -> ActorWorker.generate -> rollout.generation.generate): the modes really run
(forward counts differ as each mode's docstring says) and give the same greedy tokens; bad values are refused by
key name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_ppo.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_ppo import _overrides, data_dir  # noqa: E402,F401  (helpers and fixture reused)


def _rollout_with(cfg, parts, prompts):
    """(responses, response_lengths, forward batch shapes of the actor, the DecodeOptions generation received)."""
    from megatron_ppo.rollout import megatron as megatron_engine
    from megatron_ppo.rollout.source import OnlineSource, sampling_params

    from megatron_ppo.testing.forwards import record_forward_shapes

    seen = []
    real = megatron_engine.generate

    def recording_generate(model, prompt_ids, params, options, **kw):  # records, then runs the real generation
        seen.append(options)
        return real(model, prompt_ids, params, options, **kw)

    model = parts.actor.worker.model
    shapes, handle = record_forward_shapes(model)
    megatron_engine.generate = recording_generate
    engine = parts.actor.worker.engine
    parts.actor.worker.engine = megatron_engine.build_engine(parts.actor.worker, cfg)  # this config's engine
    try:
        source = OnlineSource(None, parts.actor, sampling_params(cfg.rollout, cfg.data.max_response_length,
                                                                 parts.eos_token_ids, parts.tokenizer.pad_token_id),
                              cfg.rollout.n)
        batch = source.generate(prompts, step=1)
    finally:
        megatron_engine.generate = real
        parts.actor.worker.engine = engine
        handle.remove()
    return batch.responses, batch.response_lengths, shapes, seen[0]


def test_prefill_drop_finished_and_compile_keys_reach_generation(data_dir, tmp_path):
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components

    base = _overrides(data_dir, tmp_path, **{"rollout.do_sample": "false", "data.max_response_length": 6})
    cfg = load_config("tiny_cpu", base)
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        prompts = parts.source.dataset.collate(parts.sampler.next_batch())
        # prompts of different lengths (the tiny set's are all equal): drop leading tokens of some rows, as left
        # padding (attention_mask 0) of the collated batch
        for row, cut in ((1, 5), (2, 12)):
            prompts["attention_mask"][row, :cut] = 0
        lengths = prompts["attention_mask"].sum(1)
        assert int(lengths.max()) - int(lengths.min()) >= 12, lengths
        runs = {}
        for name, extra in {"ragged": ["rollout.megatron.prefill=ragged"],
                            "aligned": ["rollout.megatron.prefill=aligned", "rollout.megatron.drop_finished=false"],
                            "compiled": ["rollout.megatron.use_torch_compile=true"]}.items():
            runs[name] = _rollout_with(load_config("tiny_cpu", base + extra), parts, prompts)
        parts.tracker.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    r = 6
    ragged, aligned, compiled = runs["ragged"], runs["aligned"], runs["compiled"]
    assert (ragged[3].prefill, ragged[3].drop_finished, ragged[3].compile_decode) == ("ragged", True, False)
    assert (aligned[3].prefill, aligned[3].drop_finished) == ("aligned", False)
    assert compiled[3].compile_decode and compiled[3].prefill == "auto"
    # the aligned loop advances one position per step from the shortest prompt; ragged prefills in length groups
    assert len(aligned[2]) == int(lengths.max() - lengths.min()) + r, aligned[2]
    assert len(ragged[2]) < len(aligned[2]) and all(s[1] == 1 for s in ragged[2][-(r - 1):]), ragged[2]
    for other in (aligned, compiled):
        assert torch.equal(other[0], ragged[0]) and torch.equal(other[1], ragged[1])


@pytest.mark.parametrize("override, message", [
    ("rollout.megatron.prefill=left", "rollout.megatron.prefill"),
    ("rollout.megatron.drop_finished=maybe", "rollout.megatron.drop_finished"),
    ("rollout.megatron.use_torch_compile=2", "rollout.megatron.use_torch_compile"),
    ("rollout.prefill=ragged", "'prefill' exists as 'rollout.megatron.prefill'"),  # the key before issue 24
    ("rollout.name=sglang", "rollout.name"),  # an engine we do not have
])
def test_bad_generation_keys_are_refused_by_name(override, message):
    from megatron_ppo.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config("tiny_cpu", [override])
