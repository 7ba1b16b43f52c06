"""``megatron-ppo convert verify``: load a dist checkpoint into a Megatron model and compare its logits with the HF
model's. ``load_dist_checkpoint`` and ``megatron_logits`` are also what the tests use to run a converted model.

The bitwise HF <-> HF comparison and the cache-free greedy decode the round-trip tests use live in
megatron_ppo/testing/conversion.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ppo.convert.mapping import arch_from_hf_config


def load_dist_checkpoint(model, ckpt_dir: str, strict: bool = True) -> None:
    """Load ``ckpt_dir`` into ``model`` (any TP/PP; call on every rank of the model's groups).

    strict: also fail on checkpoint keys the model does not have (megatron's default only fails on missing ones).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, ckpt_dir,
                                    strict=StrictHandling.RAISE_ALL if strict else StrictHandling.ASSUME_OK_UNEXPECTED)
    result = model.load_state_dict(state, strict=True)
    if result is not None and (result.missing_keys or result.unexpected_keys):
        raise RuntimeError(f"load_state_dict: missing {result.missing_keys}, unexpected {result.unexpected_keys}")


@torch.no_grad()
def megatron_stage_forward(model, input_ids: torch.Tensor, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
    """One pipeline stage's forward on [b, s] tokens: hidden states out of a middle stage, full-vocab (padded)
    logits [b, s, Vp] out of the last (gathered over TP). Causal attention, positions 0..s-1."""
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    if hidden_in is not None:
        model.set_input_tensor(hidden_in)
    return model(input_ids, position_ids, None, runtime_gather_output=True)


@torch.no_grad()
def megatron_logits(model, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocab logits [b, s, vocab_size] through all pipeline stages (point-to-point between stages).

    Every rank calls it; the last stage returns the logits, the others None.
    """
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return megatron_stage_forward(model, input_ids)[..., :vocab_size].float()
    rank = ps.get_pipeline_model_parallel_rank()
    b, s = input_ids.shape
    hidden_in = None
    if rank > 0:
        hidden_in = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(hidden_in, src=ps.get_pipeline_model_parallel_prev_rank())
    out = megatron_stage_forward(model, input_ids, hidden_in)
    if rank < pp - 1:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out[..., :vocab_size].float()


def verify(hf_dir: str, mcore_dir: str, tokens: int = 32, batch: int = 2, seed: int = 0) -> float:
    """Max |logit difference| between the HF model and the Megatron model (TP=1, PP=1, fp32) loaded from
    ``mcore_dir``, on random tokens. Holds both models in memory: meant for models that fit on one machine."""
    from transformers import AutoModelForCausalLM

    from megatron_ppo import parallel
    from megatron_ppo.models.gpt import build_gpt_model

    arch = arch_from_hf_config(hf_dir)
    ids = torch.randint(0, arch.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf_model(ids).logits.float()
    del hf_model
    parallel.initialize(tp=1, pp=1)
    try:
        model = build_gpt_model(arch).eval()
        load_dist_checkpoint(model, mcore_dir, strict=False)
        got = megatron_logits(model, ids, arch.vocab_size)
    finally:
        parallel.destroy()
    return float((got - want).abs().max())
