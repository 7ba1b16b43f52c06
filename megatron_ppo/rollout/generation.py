"""Batched generation for online rollouts: the front door (``generate``), sampling, and megatron's-forward loops.

``generate`` runs the static decode loop (``rollout.static_loop``: a preallocated KV cache, no host read in the
decode step, batch buckets, CUDA graphs on a GPU; docs/rollout.md) for every model ``decode_step.StaticStep`` covers.
A model it does not cover (MoE, MLA, ...: ``decode_step.unsupported_reason``, logged once as a WARNING),
``DecodeOptions(static_step=False)`` and ``use_kv_cache=False`` take the loops below, over ``GPTModel.forward``
with megatron's ``StaticInferenceContext``.

Why not megatron's inference engines: the dynamic engine needs flash-attn and CUDA; the legacy static engine
(``StaticInferenceEngine(legacy=True)``) runs on CPU but only through a text-generation controller built around
tokenizers/detokenisation, CUDA events and its own request objects, and is on its way out. What PPO needs is
narrow — token ids in, token ids and the rollout log-probs of the sampled tokens out, identical on every rank.

Two ways megatron's forward path fills the cache with prompts of different lengths (``DecodeOptions.prefill``,
docs/models.md):

* ``"ragged"`` (default where the core attention takes a mask: our ``SDPACoreAttention``): prompts are left-padded
  to the longest; with the KV cache the rows, sorted by length, are prefilled in groups of similar lengths
  (``prefill_groups``: one forward each, a group computing only its own prompts' columns; on a GPU one group) with a
  causal + key-padding mask, then every row decodes one token per step (``max_response_length`` steps at most).
  Each row's tokens sit at columns ``pad_i .. pad_i+n-1``; RoPE is relative (q.k depends on the position
  difference only), so the attention scores equal those of the row alone at positions 0..n-1 up to float rounding
  (~1e-6 in fp32). The static loop prefills the same way.
* ``"aligned"`` (needs no mask, so TE's fused attention works unchanged; the default for any other core
  attention): as megatron's legacy engine does, the batch prefills up to the shortest prompt, then advances one
  position per step; a row still inside its prompt takes its next prompt token instead of the sample.
  ``(longest - shortest prompt) + max_response_length`` steps.

On megatron's forward path finished rows (eos or length) leave the decode batch every step (``drop_finished``):
their KV-cache rows are compacted away. Results do not depend on it.

Rollout log-probs are ``log_softmax(logits / temperature)`` at the chosen token, over the full (true) vocab, before
top-k / top-p truncation — the quantity the trainer recomputes teacher-forced with the same temperature. It is
computed as ``scaled[token] - logsumexp(scaled)`` (no [B, V] log-softmax copy). Sampling draws one uniform per row
and inverts the CDF (no [B, V] exponential draw as ``torch.multinomial`` does); top-k / top-p filters run only when
enabled.

Keys are cached RoPE-rotated (``attention.CachedRopeSelfAttention``: megatron re-rotates the whole cache every
step), bit-identical to megatron's path. The prefill forwards' GEMMs may run on oneDNN (``onednn_prefill``,
``ops.cpu_matmul``; a worker passes its own ``cpu_gemm`` decision, so ``auto`` keeps a small model's prefill on
torch's GEMMs). ``compile_decode`` (``rollout.megatron.use_torch_compile``) compiles the static decode step
(``fullgraph=True``), or on this path the one-token forwards (``torch.compile(dynamic=True)``).

Parallelism: TP>1 (logits gathered over TP), PP>1 (hidden states passed stage to stage with send/recv; the last
stage samples; the static loop sends micro-batches round the stages, ``rollout.pipeline_decode``), sequence parallelism switched off during generation and restored after. Only the last stage's
first TP rank samples; its tokens and log-probs are broadcast (one collective per step) to the whole model-parallel
group, so all ranks return the same result. Deterministic under ``SamplingParams.seed``.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_ppo.rollout.decode_step import unsupported_reason
from megatron_ppo.models.unwrap import unwrap_model
from megatron_ppo.ops.cpu_matmul import onednn_matmul
from megatron_ppo.rollout.base import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)
PREFILL_MODES = ("auto", "ragged", "aligned")


@dataclass(frozen=True)
class DecodeOptions:
    """How this engine runs the decode loop (rollout.megatron.*): never changes which tokens come out."""
    prefill: str = "auto"  # "auto" | "ragged" | "aligned" (module docstring)
    drop_finished: bool = True  # finished rows leave the decode batch at bucket boundaries (results unchanged)
    compile_decode: bool = False  # torch.compile the one-token decode step (module docstring)
    static_step: bool = True  # the static loop (rollout.static_loop) where the model allows it
    packed_linears: bool = True  # ... with oneDNN-prepacked GEMM weights where possible (CPU fp32; decode_step)
    onednn_prefill: bool = True  # prefill (and any non-static forward) GEMMs on oneDNN (CPU fp32; ops.cpu_matmul);
    # the engine sets it to its worker's own cpu_gemm decision (MegatronWorker.onednn)
    cuda_graphs: str = "auto"  # "auto" (on a CUDA device) | "true" | "false": the static decode step as CUDA graphs
    batch_buckets: tuple = ()  # decode batch sizes to compact to (empty: powers of two)
    alive_check_interval: int = 8  # decode steps between the host's reads of the unfinished count
    prefill_token_budget: int = 16384  # at most this many prompt tokens (rows x padded length) per prefill forward
    max_num_seqs: int = 256  # rows the static loop decodes at once (vLLM's name); more are decoded in turns

    def __post_init__(self):
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"DecodeOptions.prefill must be one of {PREFILL_MODES}, got {self.prefill!r}")
        if min(self.alive_check_interval, self.prefill_token_budget, self.max_num_seqs) < 1:
            raise ValueError("DecodeOptions: alive_check_interval, prefill_token_budget and max_num_seqs must be >= 1")


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


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of [B, V] probabilities (zeros never drawn) by inverting the CDF at ``u`` [B] in [0, 1).

    Exact in distribution like ``torch.multinomial(probs, 1)``, which draws B*V exponentials instead of B uniforms.
    """
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    # right=True: the first index whose cdf exceeds u*total, so a zero-probability entry (flat cdf) is never hit;
    # u*total may round up to total: then the last entry with mass (where the cdf first reaches total).
    idx = torch.searchsorted(cdf, u.to(torch.float64).view(-1, 1) * total, right=True)
    return torch.minimum(idx, torch.searchsorted(cdf, total)).squeeze(-1)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                u: torch.Tensor | None = None):
    """(tokens [B], log_probs [B] float32) from last-position logits [B, V] (true vocab only).

    ``u``: the rows' uniforms (else drawn from ``generator``); the log-prob is ``scaled[tok] - logsumexp(scaled)``.
    """
    scaled = logits.float()
    if params.temperature != 1.0:
        scaled = scaled / params.temperature
    lse = torch.logsumexp(scaled, dim=-1)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        if u is None:
            u = torch.rand(scaled.shape[0], generator=generator, dtype=torch.float64, device=scaled.device)
        filtered = filter_logits(scaled, params.top_k, params.top_p)
        tokens = sample_from_probs(torch.softmax(filtered, dim=-1), u)
    return tokens, scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse


class _StageRunner:
    """One forward step of this pipeline stage, passing hidden states between stages (PP > 1)."""

    def __init__(self, model, batch_size, max_len, use_kv_cache, compile_decode=False, onednn_prefill=False):
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
        self.compiled = _compiled_forward() if compile_decode and use_kv_cache else None
        # prefill (and any non-lean forward) on oneDNN GEMMs too (ops/cpu_matmul.py), CPU only
        self.onednn = onednn_prefill and self.device.type == "cpu"

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None = None):
        """ids: [B, s] the tokens of this step; mask: megatron attention mask (True = masked) or None (causal).

        Returns last-position logits [B, V_padded] on the last stage, else None."""
        b, s = ids.shape
        if not self.first:
            h = torch.empty(s, b, self.hidden, dtype=self.dtype, device=self.device)
            dist.recv(h, src=self.ps.get_pipeline_model_parallel_prev_rank())
            self.core.set_input_tensor(h)
        if self.compiled is not None and s == 1:  # a decode step
            out = self.compiled(self.model, ids, mask, self.ctx)
        else:
            with onednn_matmul(self.onednn):
                out = _forward(self.model, ids, mask, self.ctx)
        if self.ctx is not None:
            self.ctx.sequence_len_offset += s
        if not self.last:
            dist.send(out.contiguous(), dst=self.ps.get_pipeline_model_parallel_next_rank())
            return None
        return out[:, -1, :]

    def allocate_zeroed_cache(self, max_len: int, batch: int) -> None:
        """Pre-fill megatron's KV cache with zeros (it allocates ``torch.empty``): columns that a row never writes
        (its left padding) are masked, but a masked NaN value would still poison SDPA's weighted sum (0 * NaN)."""
        from megatron.core.transformer.attention import Attention

        mem = self.ctx.key_value_memory_dict
        for m in self.core.modules():
            if isinstance(m, Attention) and m.layer_number not in mem:
                mem[m.layer_number] = tuple(
                    torch.zeros(max_len, batch, m.num_query_groups_per_partition, dim, dtype=self.dtype,
                                device=self.device) for dim in (m.key_hidden_size, m.val_hidden_size))

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Drop batch rows from the KV cache: only rows ``keep`` (indices into the current batch) stay."""
        if self.ctx is None:
            return
        mem = self.ctx.key_value_memory_dict
        for layer, (k, v) in mem.items():
            mem[layer] = (k.index_select(1, keep), v.index_select(1, keep))
        self.ctx.max_batch_size = int(keep.numel())


def _forward(model, ids, mask, ctx):
    return model(ids, None, mask, inference_context=ctx, runtime_gather_output=True)


_COMPILED = None


def _compiled_forward():
    """``torch.compile(_forward)``, built once per process: dynamo caches the compiled graphs on ``_forward``'s code,
    guarded on the model, so later rollouts (and other models) reuse or add to that cache."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_forward, dynamic=True)
    return _COMPILED


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
    """(group, global rank, is_me) of the sampling rank: the last stage's TP-rank-0 in this model-parallel group."""
    from megatron.core import parallel_state as ps

    mine = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    if not dist.is_initialized():
        return None, None, mine
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return None, None, mine
    from megatron_ppo.parallel.platform import default_device

    src = torch.tensor([dist.get_rank() if mine else 0], dtype=torch.long, device=default_device())
    dist.all_reduce(src, group=group)
    return group, int(src), mine


def resolve_prefill(model, mode: str) -> str:
    """'ragged' or 'aligned' for this model: ragged needs a core attention that applies arbitrary masks."""
    from megatron_ppo.models.attention import SDPACoreAttention

    core = unwrap_model(model)
    kinds = {type(m) for m in core.modules() if type(m).__name__.endswith(("CoreAttention", "DotProductAttention"))}
    takes_masks = bool(kinds) and kinds <= {SDPACoreAttention}
    if mode == "auto":
        return "ragged" if takes_masks else "aligned"
    if mode == "ragged" and not takes_masks:
        raise ValueError(f"DecodeOptions.prefill='ragged' (rollout.megatron.prefill) needs SDPACoreAttention (the local spec); this model's core "
                         f"attention is {sorted(k.__name__ for k in kinds)}: use prefill='aligned' or 'auto'")
    return mode


class _Sampler:
    """Samples on the sampling rank and shares (tokens, log-probs) with the model-parallel group in one broadcast.

    Every step draws one uniform per ORIGINAL row and uses those of the rows still decoding, so which rows left the
    batch never changes another row's sample."""

    def __init__(self, params, vocab, batch, device):
        self.params, self.vocab, self.batch, self.device = params, vocab, batch, device
        self.group, self.src, self.mine = _sampler_rank()
        self.gen = torch.Generator(device=device).manual_seed(int(params.seed))

    def __call__(self, logits, rows):
        b = rows.numel()
        if self.mine:
            u = None
            if not self.params.greedy:
                u = torch.rand(self.batch, generator=self.gen, dtype=torch.float64, device=self.device)
                u = u[rows]  # rows: original indices, in decode-batch order
            nxt, lp = sample_next(logits[:, :self.vocab], self.params, u=u)
        if self.group is None:
            return nxt, lp.float()
        both = torch.empty(2, b, dtype=torch.float64, device=self.device)
        if self.mine:
            both[0] = nxt
            both[1] = lp
        dist.broadcast(both, src=self.src, group=self.group)
        return both[0].long(), both[1].float()


@torch.no_grad()
def generate(model, prompts: list[torch.Tensor], params: SamplingParams, options: DecodeOptions = DecodeOptions(), *,
             use_kv_cache: bool = True) -> GenerationOutput:
    """Generate a response for each prompt (1-D token tensors of any lengths) with this rank's model stage:
    ``params`` say what to sample, ``options`` how the loop runs."""
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, p in enumerate(prompts):
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"generate: prompt {i} must be a non-empty 1-D token tensor, got shape {tuple(p.shape)}")
    core = unwrap_model(model)
    vocab = core.arch.vocab_size if hasattr(core, "arch") else core.vocab_size
    every = torch.cat(prompts)
    if bool(((every < 0) | (every >= vocab)).any()):  # one host read for the whole batch; the loop below on error only
        for i, p in enumerate(prompts):
            if int(p.max()) >= vocab or int(p.min()) < 0:
                raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab})")
    was_training = core.training
    core.eval()
    try:
        with _no_sequence_parallel(model):
            if use_kv_cache and _takes_static_loop(core, options):
                from megatron_ppo.rollout.static_loop import generate_static

                return generate_static(model, prompts, params, options, vocab)
            loop = _generate_ragged if resolve_prefill(model, options.prefill) == "ragged" else _generate_aligned
            return loop(model, prompts, params, options, vocab, use_kv_cache)
    finally:
        core.train(was_training)


_WARNED: set = set()


def _takes_static_loop(core, options: DecodeOptions) -> bool:
    """True when this rollout runs the static loop; a model it does not cover falls back to megatron's forward
    with one WARNING per reason and process."""
    if not options.static_step or options.prefill == "aligned":
        return False
    reason = unsupported_reason(core)
    if reason is None:
        return True
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning("generation: the static decode step does not cover this model (%s): megatron's full forward "
                       "with %s prefill instead", reason, resolve_prefill(core, "auto"))
    return False


class _Results:
    """Per-row output buffers, written through original row indices."""

    def __init__(self, b, r, params, device):
        self.responses = torch.full((b, r), params.pad_token_id, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(b, r, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(b, dtype=torch.long, device=device)
        self.finished = torch.zeros(b, dtype=torch.bool, device=device)
        self.eos = torch.tensor(sorted(set(params.eos_token_ids)), dtype=torch.long, device=device)

    def is_eos(self, tokens):
        return torch.isin(tokens, self.eos) if self.eos.numel() else torch.zeros_like(tokens, dtype=torch.bool)

    def record(self, rows, step: int, tokens, log_probs, alive):
        """Write step ``step``'s samples of the original rows ``rows`` where ``alive`` (torch.where, no boolean
        indexing: it would sync the host); returns the rows that ended at eos."""
        self.responses[rows, step] = torch.where(alive, tokens, self.responses[rows, step])
        self.log_probs[rows, step] = torch.where(alive, log_probs, self.log_probs[rows, step])
        self.lengths[rows] = torch.where(alive, step + 1, self.lengths[rows])
        hit = alive & self.is_eos(tokens)
        self.finished[rows] = self.finished[rows] | hit
        return hit

    def output(self):
        return GenerationOutput(responses=self.responses, response_lengths=self.lengths, log_probs=self.log_probs,
                                finished=self.finished)


def _ragged_prefill_mask(key_pad: torch.Tensor, s: int, q_start: int = 0) -> torch.Tensor:
    """[B, 1, s - q_start, s] megatron mask (True = masked) for queries at columns q_start..s-1 over keys 0..s-1:
    causal + padded keys; a pad query sees itself (so no row is empty)."""
    k = torch.arange(s, device=key_pad.device).unsqueeze(0)
    q = torch.arange(q_start, s, device=key_pad.device).unsqueeze(1)
    return ((key_pad[:, None, None, :s] | (k > q)) & (k != q)).contiguous()


def prefill_groups(lengths: list[int], forward_cost_tokens: int) -> list[tuple[int, int]]:
    """Split rows sorted by descending prompt length into contiguous groups, one prefill forward each.

    A group ``[i, j)`` costs ``(j - i) * lengths[i]`` tokens (its rows left-padded to its longest) plus a fixed
    ``forward_cost_tokens`` per forward; exact minimum by dynamic programming (O(B^2), B = batch rows)."""
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise ValueError("prefill_groups: lengths must be sorted in descending order")
    n = len(lengths)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + (j - i) * lengths[i] + forward_cost_tokens
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


def _forward_cost_tokens(device) -> int:
    """Fixed cost of one forward, in prompt tokens: on CPU a forward's fixed (per-call) part is worth a few dozen
    prompt tokens, so prompts of quite different lengths get their own prefill forwards; on a GPU a forward's launch
    cost dwarfs a few thousand prompt tokens (one group in practice). Rollout timings: docs/bench/peer.md."""
    return 32 if torch.device(device).type == "cpu" else 4096


def _generate_ragged(model, prompts, params, options, vocab, use_kv_cache):
    """Left-padded batch, prefilled by length groups (one forward without the KV cache), then one token per step for
    every unfinished row."""
    device = next(unwrap_model(model).parameters()).device
    b, r = len(prompts), params.max_response_length
    lengths = torch.tensor([p.numel() for p in prompts], device=device)
    width = int(lengths.max())
    total = width + r
    tokens = torch.zeros(b, total, dtype=torch.long, device=device)  # inputs: 0 under the padding (masked)
    for i, p in enumerate(prompts):
        tokens[i, width - p.numel():width] = p.to(device)
    key_pad = torch.arange(total, device=device).unsqueeze(0) < (width - lengths).unsqueeze(1)  # [B, total]
    res = _Results(b, r, params, device)
    runner = _StageRunner(model, b, total, use_kv_cache, options.compile_decode, options.onednn_prefill)
    sampler = _Sampler(params, vocab, b, device)
    # original index of each row of the decode batch: longest prompts first, so length groups are contiguous
    rows = torch.argsort(lengths, descending=True, stable=True)
    alive = torch.ones(b, dtype=torch.bool, device=device)  # over the decode batch: not finished yet

    with record_function("generate/prefill"):
        if use_kv_cache:
            logits = _prefill_by_length(runner, tokens, key_pad, lengths, rows, width)
        else:
            logits = runner(tokens[rows, :width], _ragged_prefill_mask(key_pad[rows], width))
    for step in range(r):
        cur = width + step  # the column this step's token goes to
        with record_function("generate/sample"):
            nxt, lp = sampler(logits, rows)
        tokens[rows, cur] = torch.where(alive, nxt, 0)
        alive &= ~res.record(rows, step, nxt, lp, alive)
        if step + 1 == r:
            break
        n_alive = int(alive.sum())  # the one host sync per step
        if n_alive == 0:
            break
        if options.drop_finished and n_alive < rows.numel():
            with record_function("generate/drop_finished"):
                keep = alive.nonzero().squeeze(-1)
                rows, alive = rows[keep], alive[keep]
                runner.keep_rows(keep)
        if use_kv_cache:
            ids, mask = tokens[rows, cur:cur + 1], key_pad[rows][:, None, None, :cur + 1]
        else:
            ids, mask = tokens[rows, :cur + 1], _ragged_prefill_mask(key_pad[rows], cur + 1)
        with record_function("generate/decode_forward"):
            logits = runner(ids, mask)
    return res.output()


def _prefill_by_length(runner, tokens, key_pad, lengths, rows, width):
    """Fill the KV cache with every prompt: one forward per group of similar lengths (``prefill_groups``); a group
    of longest prompt L writes cache rows [i, j) at columns [width - L, width) through the static context's batch /
    sequence offsets, so no group computes the columns of its rows' padding. Returns the last stage's logits."""
    ctx = runner.ctx
    runner.allocate_zeroed_cache(ctx.max_sequence_length, ctx.max_batch_size)
    sorted_len = lengths[rows].tolist()
    pieces = []
    for i, j in prefill_groups(sorted_len, _forward_cost_tokens(tokens.device)):
        start = width - sorted_len[i]
        ctx.batch_size_offset, ctx.sequence_len_offset = i, start
        g = rows[i:j]
        pieces.append(runner(tokens[g, start:width], _ragged_prefill_mask(key_pad[g], width, start)))
    ctx.batch_size_offset, ctx.sequence_len_offset = 0, width
    return torch.cat(pieces) if runner.last else None


def _generate_aligned(model, prompts, params, options, vocab, use_kv_cache):
    """Prefill to the shortest prompt, then one position per step; rows inside their prompt take the prompt token."""
    device = next(unwrap_model(model).parameters()).device
    b, r = len(prompts), params.max_response_length
    lengths = torch.tensor([p.numel() for p in prompts], device=device)
    total = int(lengths.max()) + r
    tokens = torch.zeros(b, total, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, :p.numel()] = p.to(device)
    res = _Results(b, r, params, device)
    runner = _StageRunner(model, b, total, use_kv_cache, options.compile_decode, options.onednn_prefill)
    sampler = _Sampler(params, vocab, b, device)
    rows = torch.arange(b, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    prev, cur = 0, int(lengths.min())
    while cur < total:
        logits = runner(tokens[:, prev:cur] if use_kv_cache else tokens[:, :cur])
        nxt, lp = sampler(logits, rows)
        in_prompt = cur < lengths
        pos = cur - lengths  # response position of the token written at `cur`
        active = ~in_prompt & ~done & (pos < r)
        tokens[:, cur] = torch.where(in_prompt, tokens[:, cur], torch.where(active, nxt, 0))
        idx = pos.clamp(0, r - 1)
        res.responses[rows, idx] = torch.where(active, nxt, res.responses[rows, idx])
        res.log_probs[rows, idx] = torch.where(active, lp, res.log_probs[rows, idx])
        res.lengths += active.long()
        hit = active & res.is_eos(nxt)
        res.finished |= hit
        done |= hit | (active & (pos + 1 >= r))
        prev, cur = cur, cur + 1
        if bool(done.all()):
            break
    return res.output()
