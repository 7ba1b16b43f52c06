"""The base of the role workers: a model shard built from the config inside its rank, the forward-only pass by
micro-batches (fixed count or token budget), and the PPO update loop (epochs x mini-batches x micro-batches).

Every rank of a role runs the same loop on its DP shard; every decision a rank takes (skip the update for the
target-KL guard, a non-finite loss or gradient norm) is taken on values reduced over the pipeline and data-parallel
groups, so all ranks take the same branch and the replicas' weights never diverge. Metrics come from the last
pipeline stage and are reduced over DP with token weights (see ``reduce_metrics``); every rank ends with the same
global values, so the driver reads any one replica's answer.

DP semantics (verl's): ``ppo_mini_batch_size`` counts prompts over all replicas; a replica's mini-batch is
``ppo_mini_batch_size x rollout.n / dp`` sequences of its shard; the loss normalisers (mini-batch tokens and
sequences) are the GLOBAL counts, and each rank's loss is multiplied by dp because DDP averages the gradients over
the replicas, so DP=2 gives the gradient of DP=1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ppo import parallel, roles
from megatron_ppo.data.batch import RolloutBatch, chunk_rows, micro_batches_by_tokens, pack_rows
from megatron_ppo.workers import build
from megatron_ppo.workers.megatron_worker import MegatronWorker
from megatron_ppo.workers.update import UpdateResult

# Micro-batch metrics that are shares of the mini-batch loss (summed); all others are token-weighted means.
SHARE_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss")
# Why an update was skipped: each is counted as <role>/updates_skipped_<reason>.
SKIP_REASONS = ("nonfinite", "loss_scale_overflow", "kl_guard")


class RoleWorker(MegatronWorker):
    """One rank of a role: ``ROLE`` names its row of the roles table (megatron_ppo/roles.py), which says whether it
    trains and what head its model has."""

    ROLE = "actor"

    def __init__(self, cfg, vocab_size: int, total_steps: int = 1):
        self.cfg = cfg
        self.spec = roles.spec(self.ROLE)
        trainable = self.spec.trainable
        par = getattr(cfg.cluster, self.ROLE)
        arch = build.model_arch(cfg, self.ROLE, vocab_size)  # vocab_size: the tokenizer's; the model may have more
        self.vocab_size = arch.vocab_size  # log-probs over the model's vocabulary (sampling draws from all of it)
        # Re-seed before building: the reference (same layout and seed) starts bit-identical to the actor, whether
        # it lives in the actor's process (launcher=local) or in its own (Ray).
        parallel.seed_everything(cfg.trainer.seed)
        role_cfg = getattr(cfg, self.ROLE)
        super().__init__(self.ROLE, arch,
                         optim=role_cfg.optim if trainable else None, total_steps=total_steps,
                         params_dtype=build.params_dtype(cfg, self.ROLE),
                         use_distributed_optimizer=par.use_distributed_optimizer if trainable else False,
                         recompute=build.recompute(cfg, self.ROLE), sequence_parallel=par.sequence_parallel,
                         cpu_gemm=cfg.model_for(self.ROLE).cpu_gemm)
        # sequence parallelism splits the packed row over TP: every sequence padded to a multiple of TP
        self.align = parallel.tp_size() if par.sequence_parallel and parallel.tp_size() > 1 else 1
        if getattr(role_cfg, "value_head_init", "normal") == "zeros":
            self._zero_value_head()
        path = cfg.model_for(self.ROLE).path
        if path is not None:  # a reward model's trained score head replaces a zeroed one
            from megatron_ppo.convert.hf_import import load_hf_weights

            load_hf_weights(self.model, self.ROLE, path)  # each rank reads its own slices of the HF files
        self._reload_main_params()

    # ------------------------------------------------------------------------------------------- profiling
    def profile_start(self, step: int) -> None:
        """global_profiler: start this rank's profile of ``step`` if this rank is one of global_profiler.ranks
        (profiling.StepProfiler; the driver calls it only for the chosen steps)."""
        from megatron_ppo import profiling

        if parallel.world_rank() not in profiling.profiled_ranks(self.cfg):
            return
        g = self.cfg.global_profiler
        self.profiler = getattr(self, "profiler", None) or profiling.StepProfiler(
            g.tool, g.steps, profiling.save_root(self.cfg), f"{self.ROLE}_rank{parallel.world_rank()}")
        self.profiler.start(step)

    def profile_stop(self, step: int) -> list[str]:
        """The files this rank's profile of ``step`` wrote (none where it did not profile)."""
        profiler = getattr(self, "profiler", None)
        return profiler.stop(step) if profiler is not None else []

    def device_name(self) -> str | None:
        """This rank's GPU as torch names it (MFU's peak: megatron_ppo/perf.py); None on the CPU."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    def _zero_value_head(self) -> None:
        """critic.value_head_init=zeros: the fresh value head starts at 0, so the first values are 0 on every token
        (see the key's description in config/schema.py for why)."""
        head = getattr(self.model, "output_layer", None) if self.spec.value_model else None
        if head is None:  # not the last pipeline stage: no head here
            return
        with torch.no_grad():
            for param in head.parameters():
                param.zero_()

    def _reload_main_params(self) -> None:
        """After weights were written into the model outside the optimizer: bf16 / fp16 training keeps fp32 main
        copies of the parameters, taken when the optimizer was built (the random init), and every step writes them
        back into the model; without this the first step would turn the loaded model back into the random one
        (Megatron's ``reload_model_params``; a no-op for fp32 parameters)."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's shard: model weights (and optimizer state for a trainable role)."""
        self.current_params()
        out = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self._reload_main_params()

    def save_checkpoint(self, directory: str) -> dict:
        """Write this role's model (+ optimizer) shards into ``directory`` (dist_checkpointing: collective over the
        role's ranks, reloadable at another layout); returns this rank's small state for the driver to store: the
        lr schedule, the target-KL guard (actor) and every RNG of this process (parallel/rng_state.py)."""
        from megatron_ppo.models.checkpoint import save_checkpoint
        from megatron_ppo.parallel.rng_state import capture_rng

        rng = capture_rng()  # before the save: whatever the save itself draws is not part of the run
        self.current_params()
        save_checkpoint(self.model, directory, self.optimizer)
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "guard": self.guard_state(), "rng": rng, "layout": parallel.layout()}

    def load_checkpoint(self, directory: str, rank_states: list[dict]) -> dict:
        """Load ``directory`` (saved at any layout) and the small per-rank states ``save_checkpoint`` returned.

        The lr schedule and guard are identical on every saving rank, so rank 0's serve any layout; the RNG states
        are restored only at the layout they were saved at (this rank's own; at another layout there is no
        matching rank, and bit-exact continuation is not expected). Returns {"rng_restored": bool}."""
        from megatron_ppo.models.checkpoint import load_checkpoint
        from megatron_ppo.parallel.rng_state import restore_rng

        load_checkpoint(self.model, directory, self.optimizer)
        first = rank_states[0]
        if self.scheduler is not None and first["scheduler"] is not None:
            self.scheduler.load_state_dict(first["scheduler"])
        if first.get("guard") is not None and getattr(self, "guard", None) is not None:
            self.guard.load_state_dict(first["guard"])
        same = _same_layout(rank_states)
        if same:
            restore_rng(rank_states[parallel.world_rank()]["rng"])
        return {"rng_restored": same}

    def load_weights(self, directory: str) -> dict:
        """The model's weights only from a role directory of a trainer checkpoint (any layout; no optimizer, no
        schedules): what `megatron-ppo eval` needs. Returns the checkpoint's meta."""
        from megatron_ppo.models.checkpoint import load_checkpoint

        return load_checkpoint(self.model, directory, None)

    def guard_state(self) -> dict | None:
        return None

    def rng_state(self) -> dict:
        from megatron_ppo.parallel.rng_state import capture_rng

        return {"rng": capture_rng(), "layout": parallel.layout()}

    def restore_rng_state(self, rank_states: list[dict]) -> bool:
        """A frozen role's RNGs (it has no other state): restored at the saving layout only."""
        from megatron_ppo.parallel.rng_state import restore_rng

        same = _same_layout(rank_states)
        if same:
            restore_rng(rank_states[parallel.world_rank()]["rng"])
        return same

    def release_heap(self) -> float:
        """Return this rank's free heap to the OS (models/heap.py); the GB it gave back. The driver calls it on every
        role before a checkpoint save, so that one role's save copies do not come on top of the other roles'
        retained peaks on a shared host (a SmolLM2 run peaked at 23.84 of 24 GB: docs/bench/learning_smollm2.md)."""
        import psutil

        from megatron_ppo.models.heap import release_free_heap

        before = psutil.Process().memory_info().rss
        release_free_heap()
        return max(0.0, (before - psutil.Process().memory_info().rss) / 1e9)

    def torch_threads(self) -> int:
        """The intra-op thread count this rank computes with (set from its bundle's CPUs at start-up)."""
        return torch.get_num_threads()

    # ------------------------------------------------------------------------------------------------ helpers
    def micro_rows(self, batch: RolloutBatch, rows: list[int], size, dynamic: bool, max_tokens: int):
        """``rows`` as micro-batches: a fixed number of rows, or (dynamic) a token budget per micro-batch."""
        if dynamic:
            return micro_batches_by_tokens(batch, rows, max_tokens, align=self.align)
        return chunk_rows(rows, size or len(rows))

    def forward_rows(self, batch: RolloutBatch, size, dynamic: bool, max_tokens: int, output_fn,
                     mask: bool = True) -> dict | None:
        """Forward-only outputs of every row, in row order; None on a non-last pipeline stage. ``mask``: the
        outputs are per-token [B, R] and zeroed past each response (else per-row values, as they come)."""
        groups = self.micro_rows(batch, list(range(batch.size)), size, dynamic, max_tokens)
        outputs = self.forward([pack_rows(batch, g, align=self.align) for g in groups], output_fn)
        if not outputs:
            return None
        order = torch.argsort(torch.as_tensor([r for g in groups for r in g]))
        out = {key: torch.cat([o[key] for o in outputs])[order] for key in outputs[0]}
        return {key: value * batch.response_mask for key, value in out.items()} if mask else out

    @classmethod
    def update_inputs(cls, cfg, available) -> tuple[str, ...]:
        """The per-token tensors this role's update reads, of those the driver's batch has (``available``): the
        driver sends exactly these (the worker's loss is the one place that knows)."""
        return ()

    def update(self, batch: RolloutBatch, step: int) -> UpdateResult:
        """The role's PPO update on this rank's shard of the batch (epochs x mini-batches x micro-batches)."""
        return self.run_update(batch, step, self.update_inputs(self.cfg, batch.tensors), self.make_loss,
                               getattr(self, "guard", None))

    def make_loss(self, mini_batch_tokens: int, mini_batch_seqs: int):
        raise NotImplementedError(f"{type(self).__name__}: a trainable role builds its loss here")

    def run_update(self, batch: RolloutBatch, step: int, keys: tuple, make_loss, guard=None) -> UpdateResult:
        """ppo_epochs x mini-batches x micro-batches of this rank's shard, one optimizer step per mini-batch;
        returns the step's global metrics (identical on every rank) and advances the lr schedule once."""
        rc = getattr(self.cfg, self.ROLE)
        dp = parallel.dp_size()
        mini = max(rc.ppo_mini_batch_size * self.cfg.rollout.n // dp, 1)
        results = []
        for epoch in range(rc.ppo_epochs):
            order = list(range(batch.size))
            if rc.shuffle:
                order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(
                    self.cfg.trainer.seed * 1000 + step * 10 + epoch)).tolist()
            for rows in chunk_rows(order, mini):
                groups = self.micro_rows(batch, rows, rc.ppo_micro_batch_size_per_gpu, rc.use_dynamic_bsz,
                                         rc.ppo_max_token_len_per_gpu)
                micros = [pack_rows(batch, g, keys, align=self.align) for g in groups]
                tokens, seqs = parallel.dp_sum([float(batch.loss_mask[rows].sum()), float(len(rows))])
                loss_fn = _scaled(make_loss(int(round(tokens)), int(round(seqs))), dp)
                weights = [float(batch.loss_mask[g].sum()) for g in groups]
                reduced = {}

                def decide(per_micro, weights=weights, reduced=reduced):
                    reduced.update(reduce_metrics(per_micro, weights))
                    return guard is not None and parallel.any_rank(guard.should_skip(reduced["actor/ppo_kl_k3"]))

                result = self.train_step(micros, loss_fn, decide)
                if result["skip_reason"] == "nonfinite":  # every rank agrees on it: the collective is safe
                    result["global_loss"] = _global_loss(result["loss"], dp)
                results.append({**result, "metrics": reduced})
        return self._summarise(results)

    def _summarise(self, results: list[dict]) -> UpdateResult:
        role = self.ROLE
        metrics = {key: sum(r["metrics"][key] for r in results) / len(results) for key in results[0]["metrics"]}
        stepped = [r["grad_norm"] for r in results if not r["update_skipped"]]
        metrics[f"{role}/grad_norm"] = sum(stepped) / len(stepped) if stepped else float("nan")
        metrics[f"{role}/lr"] = self.step_lr_scheduler()
        metrics[f"{role}/updates_skipped"] = float(sum(r["update_skipped"] for r in results))
        for reason in SKIP_REASONS:
            metrics[f"{role}/updates_skipped_{reason}"] = float(sum(r["skip_reason"] == reason for r in results))
        if self.device.type == "cuda":
            metrics.update(device_memory_metrics(role))
        bad = [r for r in results if r["skip_reason"] == "nonfinite"]
        return UpdateResult(metrics=metrics, optimizer_steps=len(results), nonfinite_skips=len(bad),
                            nonfinite_losses=[r["global_loss"] for r in bad],
                            nonfinite_grad_norms=[r["grad_norm"] for r in bad])


def device_memory_metrics(role: str) -> dict:
    """perf/max_memory_{allocated,reserved}_gb/<role>: the allocator's peaks since the last update, the largest over
    the role's ranks (on a GPU; nothing on the CPU). Every rank calls it: a collective."""
    if not torch.cuda.is_available():
        return {}
    peaks = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        peaks = parallel.all_reduce(peaks, None, dist.ReduceOp.MAX)
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = (float(v) / 2 ** 30 for v in peaks.tolist())
    return {f"perf/max_memory_allocated_gb/{role}": allocated, f"perf/max_memory_reserved_gb/{role}": reserved}


def _same_layout(rank_states: list[dict]) -> bool:
    """Saved at this very layout (so this rank's own saved RNG state exists)."""
    return len(rank_states) == parallel.world_size() and \
        rank_states[parallel.world_rank()]["layout"] == parallel.layout()


def _scaled(loss_fn, dp: int):
    """The loss times dp (DDP averages gradients over the replicas; the normalisers are global counts)."""

    def scaled(output, micro):
        loss, metrics = loss_fn(output, micro)
        return (loss * dp if dp > 1 else loss), metrics

    return scaled


def _global_loss(rank_loss: float, dp: int) -> float:
    """The mini-batch's (unscaled) loss: this rank's summed micro-batch losses (x dp; only the last pipeline stage
    has any) summed over the pipeline and data-parallel groups."""
    from megatron_ppo.parallel import _ps

    t = torch.tensor([rank_loss / dp], dtype=torch.float64)
    if parallel.pp_size() > 1:
        t = parallel.all_reduce(t, _ps().get_pipeline_model_parallel_group())
    if dp > 1:
        t = parallel.all_reduce(t, parallel.dp_group())
    return float(t[0])


def reduce_metrics(per_micro: list[dict], weights: list[float]) -> dict:
    """One mini-batch's metrics, global and identical on every rank.

    per_micro: this rank's micro-batch metrics (empty on a non-last pipeline stage), weights: each micro-batch's
    loss-mask tokens. Shares of the loss (SHARE_METRICS, normalised by the global mini-batch already) are summed;
    every other metric is a per-micro-batch masked mean and becomes a token-weighted mean. The key list comes from
    the last stage (broadcast over the pipeline group); sums go over the pipeline group (only the last stage
    contributes) and the data-parallel group.
    """
    from megatron.core import parallel_state

    pp = parallel.pp_size()
    keys = sorted(per_micro[0]) if per_micro else []
    if pp > 1:
        holder = [keys]
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(holder, src=last, group=parallel_state.get_pipeline_model_parallel_group())
        keys = holder[0]
    vec = torch.zeros(len(keys) + 1, dtype=torch.float64)
    if per_micro:
        for j, key in enumerate(keys):
            if key in SHARE_METRICS:
                vec[j] = sum(m[key] for m in per_micro)
            else:
                vec[j] = sum(m[key] * w for m, w in zip(per_micro, weights))
        vec[-1] = sum(weights)
    if pp > 1:
        vec = parallel.all_reduce(vec, parallel_state.get_pipeline_model_parallel_group())
    if parallel.dp_size() > 1:
        vec = parallel.all_reduce(vec, parallel.dp_group())
    values = vec.tolist()  # one read
    total = values[-1]
    return {key: values[j] if key in SHARE_METRICS else (values[j] / total if total > 0 else 0.0)
            for j, key in enumerate(keys)}
