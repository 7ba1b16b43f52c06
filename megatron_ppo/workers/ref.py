"""RefWorker: the frozen reference policy's log-probs, on one rank of the reference's layout. Without a model
of its own it is built as the actor is, from the same seed, so it starts as the actor's initial policy."""
from __future__ import annotations

from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.workers.losses import logprob_output_fn
from megatron_ppo.workers.role import RoleWorker


class RefWorker(RoleWorker):
    ROLE = "ref"

    def compute_log_probs(self, batch: RolloutBatch) -> dict | None:
        """{"log_probs", "entropy"} [B, R] under the reference (ref.log_prob_* micro-batches)."""
        r = self.cfg.ref
        return self.forward_rows(batch, r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz,
                                 r.log_prob_max_token_len_per_gpu,
                                 logprob_output_fn(self.vocab_size, self.cfg.rollout.temperature))
