"""The Megatron engine's static decode loop: ragged prefill, then one-token steps over a preallocated cache with
batch buckets, a lagged alive count and (on a GPU) one CUDA graph per bucket. docs/rollout.md, "The Megatron
engine's static decode step", says why each piece is there.

* **Prefill**: rows sorted by prompt length, prefilled in groups of similar lengths (``prefill_groups``), each group
  split so that a forward holds at most ``prefill_token_budget`` tokens; each forward computes only its rows' prompt
  columns and attends over them alone (causal + key padding), through ``StaticStep``.
* **Decode**: every row of the current bucket decodes one token per step at the same cache column (prompts are
  left-padded to the longest); a finished row is masked (its sample is dropped, its column written with token 0),
  not removed.
* **Buckets**: the batch is compacted (``StaticKVCache.keep_rows``) only when the host learns that the unfinished
  rows fit a smaller bucket (``batch_buckets``: the configured sizes, else powers of two, below the batch), so a
  rollout has at most one decode shape (one graph) per bucket.
* **Host reads**: the unfinished count is the only thing the host reads while decoding: copied without blocking
  after every ``alive_check_interval``-th step and read one step later (``AliveCount``), so the device is never
  drained to answer it. It decides compaction and the early stop (all rows done).
* **Turns and stages**: at most ``max_num_seqs`` rows are decoded at once (longer rollouts in turns); with pipeline
  parallelism the rows go round the stages as micro-batches (``rollout.pipeline_decode``).
"""
from __future__ import annotations

import logging

import torch
from torch.profiler import record_function

from megatron_ppo.models.unwrap import unwrap_model
from megatron_ppo.ops.cpu_matmul import onednn_matmul
from megatron_ppo.rollout.decode_step import StaticKVCache, StaticStep
from megatron_ppo.rollout.pipeline_decode import StepSampler, decode_pipelined, share_results

logger = logging.getLogger(__name__)
CUDA_GRAPHS = ("auto", "true", "false")
_CAPTURE_FAILED = None  # why a capture failed in this process (cuda_graphs=auto then decodes eagerly)


def batch_buckets(batch: int, sizes=()) -> list[int]:
    """The decode batch sizes a rollout of ``batch`` rows may run at, largest first: ``batch`` itself, then the
    configured ``sizes`` below it, else the powers of two below it."""
    below = sorted({int(s) for s in sizes if 0 < int(s) < batch}, reverse=True) if sizes else []
    if not sizes:
        p = 1
        while p < batch:
            below.insert(0, p)
            p *= 2
    return [batch] + below


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds ``n`` rows (buckets largest first; the first holds every row)."""
    fits = [b for b in buckets if b >= n]
    return fits[-1] if fits else buckets[0]


def prefill_chunks(groups: list[tuple[int, int]], sorted_lengths: list[int], token_budget: int):
    """Split each prefill group ``[i, j)`` (rows left-padded to ``sorted_lengths[i]``) into forwards of at most
    ``token_budget`` tokens (at least one row each)."""
    out = []
    for i, j in groups:
        rows = max(1, token_budget // max(1, sorted_lengths[i]))
        out.extend((a, min(a + rows, j)) for a in range(i, j, rows))
    return out


class AliveCount:
    """The number of unfinished rows as the host sees it: after every ``every``-th step the count is copied
    (non-blocking, into pinned memory on a GPU) and read after the next step's launch, one step late. ``poll``
    returns that count or None; it is the decode loop's one host read."""

    def __init__(self, every: int, device):
        if every < 1:
            raise ValueError(f"rollout.megatron.alive_check_interval must be >= 1, got {every}")
        self.every = every
        self.cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros((), dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending = False

    def poll(self, alive: torch.Tensor, step: int):
        value = None
        if self.pending:
            if self.event is not None:
                self.event.synchronize()
            value = int(self.host)
            self.pending = False
        if (step + 1) % self.every == 0:
            self.host.copy_(alive.sum(), non_blocking=True)
            if self.event is not None:
                self.event.record()
            self.pending = True
        return value


class DecodeGraphs:
    """One CUDA graph of the decode step per bucket, captured at the bucket's first step of this rollout and
    replayed after. Captured afresh every rollout: the graph holds the addresses of this rollout's cache (allocated
    for its prompt width) and reads the weights where they are, so an update between rollouts, in place or not,
    can never leave a graph on stale tensors."""

    def __init__(self, step, strict: bool):
        self.step, self.strict = step, strict
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, x, pos, first_col, cache, rows=slice(None)):
        global _CAPTURE_FAILED
        if _CAPTURE_FAILED is not None:
            return self.step.decode(x, pos, first_col, cache, rows)
        key = (first_col.size(0), rows.start)  # a bucket, or a pipeline micro-batch's cache rows
        if key not in self.graphs:
            if rows == slice(None):
                self.graphs.clear()  # buckets only shrink within a rollout
            static = {"x": x.clone(), "first_col": first_col.clone()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (cuBLAS handles, allocator): this step's real output
                out = self.step.decode(static["x"], pos, static["first_col"], cache, rows)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):  # records; the cache writes are the warm-up's again
                    static["out"] = self.step.decode(static["x"], pos, static["first_col"], cache, rows)
            except RuntimeError as exc:  # cuda_graphs=auto: decode eagerly, said once; true: the error
                if self.strict:
                    raise
                _CAPTURE_FAILED = f"{type(exc).__name__}: {exc}".splitlines()[0]
                logger.warning("generation: capturing the decode step as a CUDA graph failed (%s): this process "
                               "decodes eagerly (rollout.megatron.cuda_graphs=auto; =true raises instead)",
                               _CAPTURE_FAILED)
                return out
            self.graphs[key] = (graph, static)
            return out
        graph, static = self.graphs[key]
        static["x"].copy_(x)
        static["first_col"].copy_(first_col)
        graph.replay()
        return static["out"]


def use_cuda_graphs(setting: str, device) -> bool:
    if setting not in CUDA_GRAPHS:
        raise ValueError(f"rollout.megatron.cuda_graphs must be one of {CUDA_GRAPHS}, got {setting!r}")
    on_cuda = torch.device(device).type == "cuda"
    if setting == "true" and not on_cuda:
        raise ValueError("rollout.megatron.cuda_graphs=true needs a CUDA device (auto: on where there is one)")
    return on_cuda and setting != "false"


class StaticRunner:
    """This stage's side of the static loop: the cache, the step (eager, compiled or graphed) and, with PP > 1,
    hidden states received from the previous stage and sent to the next."""

    def __init__(self, model, batch: int, max_len: int, options):
        from megatron.core import parallel_state as ps

        self.core = unwrap_model(model)
        self.ps = ps
        self.first = ps.is_pipeline_first_stage(ignore_virtual=True)
        self.last = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.stages = ps.get_pipeline_model_parallel_world_size()
        cfg = self.core.config
        self.hidden, self.dtype = cfg.hidden_size, cfg.params_dtype
        self.device = next(self.core.parameters()).device
        self.cache = StaticKVCache(self.core, batch, max_len, self.dtype, self.device)
        # (inductor lowers no oneDNN-prepacked weight: a compiled step runs plain GEMMs, which it may pack itself)
        self.step = StaticStep(self.core, max_len, batch, packed=options.packed_linears and not options.compile_decode)
        self.onednn = options.onednn_prefill and self.device.type == "cpu"
        self.decode_fn = self.step.decode
        if use_cuda_graphs(options.cuda_graphs, self.device):
            self.decode_fn = DecodeGraphs(self.step, strict=options.cuda_graphs == "true")
        elif options.compile_decode:
            self.decode_fn = compile_decode(self.step)

    def _input(self, ids):
        if self.first:
            return ids
        import torch.distributed as dist

        h = torch.empty(ids.size(1), ids.size(0), self.hidden, dtype=self.dtype, device=self.device)
        dist.recv(h, src=self.ps.get_pipeline_model_parallel_prev_rank())
        return h

    def _output(self, out):
        if self.last:
            return out
        import torch.distributed as dist

        dist.send(out.contiguous(), dst=self.ps.get_pipeline_model_parallel_next_rank())
        return None

    def prefill(self, ids, cols, keep, rows: slice, kv: slice):
        with onednn_matmul(self.onednn):
            return self._output(self.step(self._input(ids), cols, keep, self.cache, rows, kv))

    def decode(self, ids, pos, first_col):
        return self._output(self.decode_fn(self._input(ids), pos, first_col, self.cache))

    def keep_rows(self, keep):
        self.cache.keep_rows(keep)


def compile_decode(step):
    """``torch.compile(step.decode, fullgraph=True)``: the step has no data-dependent control flow, so it compiles
    as one graph per bucket shape (dynamo recompiles on a new batch size); a graph break raises."""
    return torch.compile(step.decode, fullgraph=True, dynamic=False)


def generate_static(model, prompts, params, options, vocab):
    """The static loop (module docstring). Returns the rows' results in their original order. Rows sorted by prompt
    length are decoded ``options.max_num_seqs`` at a time (one cache each); every row draws the uniform of its
    original index at each step, so the cap changes no sample."""
    from megatron_ppo.rollout.generation import _Results

    device = next(unwrap_model(model).parameters()).device
    res = _Results(len(prompts), params.max_response_length, params, device)
    order = sorted(range(len(prompts)), key=lambda i: -prompts[i].numel())  # longest first (stable)
    cap = options.max_num_seqs or len(order)
    for start in range(0, len(order), cap):
        runner = _generate_rows(model, prompts, order[start:start + cap], params, options, vocab, res)
    if runner.stages > 1:
        share_results(res, runner)
    return res.output()


def _generate_rows(model, prompts, order, params, options, vocab, res):
    """Prefill and decode the rows ``order`` (original indices, longest prompt first) into ``res``."""
    from megatron_ppo.rollout.generation import _forward_cost_tokens, _ragged_prefill_mask, _Sampler, prefill_groups

    device = res.responses.device
    b, r = len(order), params.max_response_length
    sorted_len = [prompts[i].numel() for i in order]
    width = sorted_len[0]
    total = width + r
    tokens = torch.zeros(b, total, dtype=torch.long, device=device)  # by cache row; 0 under the padding (masked)
    for row, i in enumerate(order):
        tokens[row, width - sorted_len[row]:width] = prompts[i].to(device)
    first_col = torch.tensor([width - n for n in sorted_len], device=device)  # each cache row's first prompt column
    key_pad = torch.arange(total, device=device).unsqueeze(0) < first_col.unsqueeze(1)  # [b, total]
    runner = StaticRunner(model, b, total, options)
    pipelined = runner.stages > 1
    sampler = (StepSampler if pipelined else _Sampler)(params, vocab, res.responses.size(0), device)
    rows = torch.tensor(order, device=device)  # original index of each cache row

    with record_function("generate/prefill"):
        pieces = []
        groups = prefill_groups(sorted_len, _forward_cost_tokens(device))
        for i, j in prefill_chunks(groups, sorted_len, options.prefill_token_budget):
            start = width - sorted_len[i]
            keep = ~_ragged_prefill_mask(key_pad[i:j], width, start)[..., start:]
            cols = torch.arange(start, width, device=device)
            pieces.append(runner.prefill(tokens[i:j, start:width], cols, keep, slice(i, j), slice(start, width)))
        logits = torch.cat(pieces) if runner.last else None

    with record_function("generate/decode_loop"):
        if pipelined:
            decode_pipelined(runner, sampler, res, logits, rows, first_col, width, r, options)
        else:
            _decode_loop(runner, sampler, res, logits, tokens, rows, first_col, width, r, options)
    return runner


def _decode_loop(runner, sampler, res, logits, tokens, rows, row_first_col, width, r, options):
    """One token per step for every row of the current bucket until every row is done or ``r`` tokens are out.
    ``rows``: each cache row's original index (into ``res``); ``tokens``: by the rows' initial cache order."""
    device = tokens.device
    slot = torch.arange(rows.numel(), device=device)  # each cache row's row of ``tokens``
    buckets = batch_buckets(rows.numel(), options.batch_buckets) if options.drop_finished else [rows.numel()]
    count = AliveCount(options.alive_check_interval, device)
    alive = torch.ones(rows.numel(), dtype=torch.bool, device=device)  # over the cache rows: not finished yet
    pos = torch.full((1,), width, dtype=torch.long, device=device)
    for step in range(r):
        cur = width + step  # the column this step's token goes to
        with record_function("generate/sample"):
            nxt, lp = sampler(logits, rows)
        tokens[slot, cur] = torch.where(alive, nxt, 0)
        alive &= ~res.record(rows, step, nxt, lp, alive)
        if step + 1 == r:
            break
        n_alive = count.poll(alive, step)
        if n_alive == 0:
            break
        if n_alive is not None and bucket_for(n_alive, buckets) < rows.numel():
            with record_function("generate/compact"):
                keep = torch.argsort((~alive).to(torch.uint8), stable=True)[:bucket_for(n_alive, buckets)]
                rows, slot, alive, row_first_col = rows[keep], slot[keep], alive[keep], row_first_col[keep]
                runner.keep_rows(keep)
        pos.fill_(cur)
        with record_function("generate/decode_forward"):
            logits = runner.decode(tokens[slot, cur:cur + 1], pos, row_first_col)
