"""Batched generation for online rollouts: a KV-cached decode loop of our own over GPTModel.forward.

Why not megatron's inference engines: the dynamic engine needs flash-attn and CUDA; the legacy static engine
(``StaticInferenceEngine(legacy=True)``) runs on CPU but only through a text-generation controller built around
tokenizers/detokenisation, CUDA events and its own request objects, and is on its way out. What PPO needs is
narrow — token ids in, token ids and the rollout log-probs of the sampled tokens out, identical on every rank — and
megatron's model already provides the KV cache (``StaticInferenceContext``). So the loop is ours (~one screen),
the attention/KV-cache/RoPE code is megatron's, and any layer spec (TE or local SDPA) works.

Prompts of different lengths need no padding mask (so TE's fused attention works unchanged): as megatron's
legacy engine does, the batch prefills up to the shortest prompt, then advances one position per step; a row still
inside its prompt takes its next prompt token instead of the sample. Every row's tokens therefore sit at positions
0..n-1, exactly as in a teacher-forced forward of that row alone.

Rollout log-probs are ``log_softmax(logits / temperature)`` at the chosen token, over the full (true) vocab, before
top-k / top-p truncation — the quantity the trainer recomputes teacher-forced with the same temperature.

Parallelism: TP>1 (logits gathered over TP), PP>1 (hidden states passed stage to stage with send/recv; the last
stage samples), sequence parallelism switched off during generation and restored after. The sampled tokens and
log-probs are broadcast from the last stage's first TP rank to the whole model-parallel group every step, so all
ranks return the same result. Deterministic under ``SamplingParams.seed``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ppo.models.unwrap import unwrap_model


@dataclass(frozen=True)
class SamplingParams:
    max_response_length: int
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.max_response_length < 1:
            raise ValueError(f"SamplingParams.max_response_length must be >= 1, got {self.max_response_length}")
        if self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature} (use greedy=True)")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    responses: torch.Tensor  # [B, R] long, pad_token_id after the end
    response_lengths: torch.Tensor  # [B] long, eos included
    log_probs: torch.Tensor  # [B, R] float32, 0 after the end
    finished: torch.Tensor  # [B] bool: ended with an eos token (else: hit max_response_length)

    def response_mask(self) -> torch.Tensor:
        r = self.responses.shape[1]
        return torch.arange(r).unsqueeze(0) < self.response_lengths.unsqueeze(1)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of [B, V] logits: removed entries become -inf (at least one is kept)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= top_p  # keeps the smallest prefix whose mass reaches top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """(tokens [B], log_probs [B]) from last-position logits [B, V] (true vocab only)."""
    scaled = logits.float() / params.temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class _StageRunner:
    """One forward step of this pipeline stage, passing hidden states between stages (PP > 1)."""

    def __init__(self, model, batch_size, max_len, use_kv_cache):
        from megatron.core import parallel_state as ps
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model = model
        self.core = unwrap_model(model)
        self.ps = ps
        self.first = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.last = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.ctx = StaticInferenceContext(batch_size, max_len) if use_kv_cache else None
        self.hidden = self.core.config.hidden_size
        self.dtype = self.core.config.params_dtype
        self.device = next(self.core.parameters()).device

    def __call__(self, ids: torch.Tensor):
        """ids: [B, s] the tokens of this step. Returns last-position logits [B, V_padded] on the last stage."""
        b, s = ids.shape
        if not self.first:
            h = torch.empty(s, b, self.hidden, dtype=self.dtype, device=self.device)
            dist.recv(h, src=self.ps.get_pipeline_model_parallel_prev_rank())
            self.core.set_input_tensor(h)
        out = self.model(ids, None, None, inference_context=self.ctx, runtime_gather_output=True)
        if self.ctx is not None:
            self.ctx.sequence_len_offset += s
        if not self.last:
            dist.send(out.contiguous(), dst=self.ps.get_pipeline_model_parallel_next_rank())
            return None
        return out[:, -1, :]


@contextlib.contextmanager
def _no_sequence_parallel(model):
    core = unwrap_model(model)
    if not core.config.sequence_parallel:
        yield
        return
    from megatron.core.transformer.utils import set_model_to_sequence_parallel

    set_model_to_sequence_parallel(core, set_to=False)
    try:
        yield
    finally:
        set_model_to_sequence_parallel(core, set_to=True)


def _sampler_rank():
    """(group, global rank) of the sampling rank: the last stage's TP-rank-0 in this model-parallel group."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return None, None
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return None, None
    mine = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    from megatron_ppo.parallel.platform import default_device

    src = torch.tensor([dist.get_rank() if mine else 0], dtype=torch.long, device=default_device())
    dist.all_reduce(src, group=group)
    return group, int(src)


def _broadcast(tensors, group, src):
    if group is None:
        return
    for t in tensors:
        dist.broadcast(t, src=src, group=group)


@torch.no_grad()
def generate(model, prompts: list[torch.Tensor], params: SamplingParams, *, use_kv_cache: bool = True
             ) -> GenerationOutput:
    """Generate a response for each prompt (1-D token tensors of any lengths) with this rank's model stage."""
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, p in enumerate(prompts):
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"generate: prompt {i} must be a non-empty 1-D token tensor, got shape {tuple(p.shape)}")
    core = unwrap_model(model)
    vocab = core.arch.vocab_size if hasattr(core, "arch") else core.vocab_size
    device = next(core.parameters()).device
    b, r = len(prompts), params.max_response_length
    lengths = torch.tensor([p.numel() for p in prompts], device=device)
    total = int(lengths.max()) + r
    tokens = torch.full((b, total), params.pad_token_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        if int(p.max()) >= vocab or int(p.min()) < 0:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab})")
        tokens[i, :p.numel()] = p.to(device)
    log_probs = torch.zeros(b, r, dtype=torch.float32, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    resp_len = torch.zeros(b, dtype=torch.long, device=device)
    eos = torch.tensor(sorted(set(params.eos_token_ids)), dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(int(params.seed))
    rows = torch.arange(b, device=device)

    was_training = core.training
    core.eval()
    try:
        with _no_sequence_parallel(model):
            runner = _StageRunner(model, b, total, use_kv_cache)
            group, src = _sampler_rank()
            prev, cur = 0, int(lengths.min())
            while cur < total:
                step_ids = tokens[:, prev:cur] if use_kv_cache else tokens[:, :cur]
                logits = runner(step_ids)
                nxt = torch.full((b,), params.pad_token_id, dtype=torch.long, device=device)
                lp = torch.zeros(b, dtype=torch.float32, device=device)
                if runner.last:
                    nxt, lp = sample_next(logits[:, :vocab], params, gen)
                    lp = lp.float()
                _broadcast([nxt, lp], group, src)
                in_prompt = cur < lengths
                pos = cur - lengths  # response position of the token written at `cur`
                active = ~in_prompt & ~done & (pos < r)
                nxt = torch.where(in_prompt, tokens[:, cur], torch.where(active, nxt, params.pad_token_id))
                tokens[:, cur] = nxt
                idx = pos.clamp(0, r - 1)
                log_probs[rows, idx] = torch.where(active, lp, log_probs[rows, idx])
                resp_len = resp_len + active.long()
                hit_eos = active & torch.isin(nxt, eos) if eos.numel() else torch.zeros_like(active)
                finished |= hit_eos
                done |= hit_eos | (active & (pos + 1 >= r))
                prev, cur = cur, cur + 1
                if bool(done.all()):
                    break
    finally:
        core.train(was_training)

    responses = torch.full((b, r), params.pad_token_id, dtype=torch.long, device=device)
    for i in range(b):
        n = int(resp_len[i])
        start = int(lengths[i])
        responses[i, :n] = tokens[i, start:start + n]
    return GenerationOutput(responses=responses, response_lengths=resp_len, log_probs=log_probs, finished=finished)
