"""ActorWorker: rollout generation, old log-probs, and the PPO policy update, on one rank of the actor's layout.

The driver sends data and the step number; the loss is built here from cfg.actor (trainer/losses.actor_loss_fn),
and the target-KL guard lives here, deciding per mini-batch on the KL reduced over the pipeline and DP groups
(identical on every rank; its counters too).
"""
from __future__ import annotations

import torch

from megatron_ppo import parallel
from megatron_ppo.algo.kl_control import TargetKLGuard
from megatron_ppo.distributed.layout import DP_SEED_STRIDE, dp_seed
from megatron_ppo.models.generation import SamplingParams
from megatron_ppo.trainer.losses import actor_loss_fn, logprob_output_fn
from megatron_ppo.workers.payload import from_payload
from megatron_ppo.workers.role import RoleWorker


class ActorWorker(RoleWorker):
    ROLE = "actor"
    MODEL_ROLE = "actor"

    def __init__(self, cfg, vocab_size: int, total_steps: int = 1):
        super().__init__(cfg, vocab_size, total_steps)
        g = cfg.algorithm.kl_guard
        self.guard = TargetKLGuard(g.target_kl) if g.enable else None

    def generate(self, prompts: dict, sampling: dict, step: int) -> dict:
        """Responses to this replica's prompts ({"prompt_ids": [...]}), padded to max_response_length.

        sampling: SamplingParams fields; its seed is the run's, and each DP replica samples with
        ``dp_seed(seed + 1000 x dp x step, dp_rank)``: different per replica and step, reproducible."""
        dp = parallel.dp_size()
        seed = dp_seed(sampling["seed"] + DP_SEED_STRIDE * dp * step, parallel.dp_rank())
        params = SamplingParams(**{**sampling, "seed": seed})
        out = super().generate(list(prompts["prompt_ids"]), params)
        width = params.max_response_length
        pad = width - out.responses.shape[1]
        responses = torch.nn.functional.pad(out.responses, (0, pad), value=params.pad_token_id)
        log_probs = torch.nn.functional.pad(out.log_probs, (0, pad), value=0.0)
        return {"responses": responses, "response_lengths": out.response_lengths, "log_probs": log_probs}

    def compute_log_probs(self, payload: dict) -> dict | None:
        """{"log_probs", "entropy"} [B, R] of the responses under the current policy (rollout temperature)."""
        r = self.cfg.rollout
        return self.forward_rows(from_payload(payload), r.log_prob_micro_batch_size_per_gpu,
                                 r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu,
                                 logprob_output_fn(self.vocab_size, r.temperature))

    def update(self, payload: dict, step: int) -> dict:
        a = self.cfg.actor
        batch = from_payload(payload)
        keys = ("old_log_probs", "advantages") + (("ref_log_probs",) if a.use_kl_loss else ()) + (
            ("rollout_is_weights",) if "rollout_is_weights" in batch.tensors else ())

        def make_loss(tokens, seqs):
            return actor_loss_fn(a, vocab_size=self.vocab_size, temperature=self.cfg.rollout.temperature,
                                 mini_batch_tokens=tokens, mini_batch_seqs=seqs,
                                 rollout_correction=self.cfg.algorithm.rollout_correction)

        metrics = self.run_update(batch, step, keys, make_loss, self.guard)
        if self.guard is not None:
            metrics.update(self.guard.step_metrics())
        return metrics

    def guard_state(self) -> dict | None:
        return None if self.guard is None else self.guard.state_dict()
