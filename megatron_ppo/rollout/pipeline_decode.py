"""The static loop's decode steps with pipeline parallelism: the rows split into micro-batches that flow through the
stages, so that every stage works at every step (docs/rollout.md, "Pipeline stages").

With PP stages and one batch, a decode step is stage-serial: stage 0 computes while the others wait, then stage 1,
... (PP - 1 stages idle on every token). Here the rows are split into ``min(PP, rows)`` micro-batches; each rank
runs, step after step, the micro-batches in order: stage 0 takes micro-batch m's tokens from the last stage, the
others its hidden states from the stage before; each sends on without waiting (``isend``). While the last stage
computes micro-batch 0, stage 0 already computes micro-batch 1, and so on round the ring.

* **Sampling**: every rank of the last stage samples its micro-batches itself (its logits are gathered over TP, the
  same on every TP rank, and its generator the same seed), with the uniforms the whole batch draws once per step,
  so each row gets the sample it gets without micro-batches. The tokens go to stage 0 point to point.
* **Stop**: every ``alive_check_interval`` steps the last stage broadcasts the unfinished count over the pipeline
  group (the loop's one host read; it drains the pipeline once per interval); at 0 every stage stops (stage 0
  first receives the tokens already sent to it). Finished rows are masked, never compacted: a micro-batch keeps its
  cache rows (and, on a GPU, its CUDA graph) for the whole rollout.
* **Results** live on the last stage; ``share_results`` broadcasts them over the pipeline group once per rollout, so
  every rank returns the same output.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function


def micro_batches(rows: int, stages: int) -> list[tuple[int, int]]:
    """``min(stages, rows)`` contiguous, near-equal row ranges covering ``rows``."""
    m = max(1, min(stages, rows))
    return [(k * rows // m, (k + 1) * rows // m) for k in range(m)]


class StepSampler:
    """The last stage's sampler: the batch's uniforms drawn once per step (``draw``), a micro-batch's rows picked from
    them; the same draws as ``generation._Sampler`` (same generator, seed and order)."""

    def __init__(self, params, vocab: int, batch: int, device):
        self.params, self.vocab, self.batch = params, vocab, batch
        self.gen = torch.Generator(device=device).manual_seed(int(params.seed))
        self.u = None

    def draw(self):
        if not self.params.greedy:
            self.u = torch.rand(self.batch, generator=self.gen, dtype=torch.float64, device=self.gen.device)

    def __call__(self, logits, rows):
        from megatron_ppo.rollout.generation import sample_next

        nxt, lp = sample_next(logits[:, :self.vocab], self.params, u=None if self.u is None else self.u[rows])
        return nxt, lp.float()


def decode_pipelined(runner, sampler: StepSampler, res, logits, rows, first_col, width, r, options):
    """Steps 0 .. r-1 of the rows ``rows`` (original indices, in cache order); ``logits``: the prefill's, on the last
    stage. Writes the samples into ``res`` on the last stage."""
    ps = runner.ps
    group = ps.get_pipeline_model_parallel_group()
    first_rank, last_rank = ps.get_pipeline_model_parallel_first_rank(), ps.get_pipeline_model_parallel_last_rank()
    prev_rank, next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    device = rows.device
    bounds = micro_batches(rows.numel(), dist.get_world_size(group))
    alive = torch.ones(rows.numel(), dtype=torch.bool, device=device)
    pos = torch.full((1,), width, dtype=torch.long, device=device)
    sends = {}  # micro-batch -> (work, tensor) of its last isend: done before the micro-batch's next forward

    def send(m, tensor, dst):
        sends[m] = (dist.isend(tensor, dst=dst), tensor)

    def sample(m, out, step):
        i, j = bounds[m]
        live = alive[i:j]
        with record_function("generate/sample"):
            nxt, lp = sampler(out, rows[i:j])
        hit = res.record(rows[i:j], step, nxt, lp, live)
        token = torch.where(live, nxt, 0).view(-1, 1)
        alive[i:j] = live & ~hit
        if step + 1 < r:
            send(m, token, first_rank)

    if runner.last:
        sampler.draw()
        for m, (i, j) in enumerate(bounds):
            sample(m, logits[i:j], 0)
    for step in range(1, r):
        pos.fill_(width + step - 1)  # the column of the token fed in (sampled at step - 1)
        if runner.last:
            sampler.draw()
        for m, (i, j) in enumerate(bounds):
            if runner.first:
                x = torch.empty(j - i, 1, dtype=torch.long, device=device)
            else:
                x = torch.empty(1, j - i, runner.hidden, dtype=runner.dtype, device=device)
            dist.recv(x, src=last_rank if runner.first else prev_rank)
            if m in sends:  # a graph's output buffer is rewritten by its next replay
                sends.pop(m)[0].wait()
            with record_function("generate/decode_forward"):
                out = runner.decode_fn(x, pos, first_col[i:j], runner.cache, slice(i, j))
            if runner.last:
                sample(m, out, step)
            else:
                send(m, out, next_rank)
        if step % options.alive_check_interval == 0 and step + 1 < r:
            count = alive.sum().view(1) if runner.last else torch.zeros(1, dtype=torch.long, device=device)
            dist.broadcast(count, src=last_rank, group=group)
            if int(count) == 0:
                if runner.first:  # the tokens the last stage sent for the next step
                    for i, j in bounds:
                        dist.recv(torch.empty(j - i, 1, dtype=torch.long, device=device), src=last_rank)
                break
    for work, _ in sends.values():
        work.wait()


def share_results(res, runner) -> None:
    """The last stage's results to every stage of this pipeline (one broadcast per tensor and rollout)."""
    ps = runner.ps
    group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    for t in (res.responses, res.log_probs, res.lengths, res.finished):
        dist.broadcast(t, src=src, group=group)
