"""CriticWorker: values of the responses and the clipped value-loss update, on one rank of the critic's layout.
The loss is built here from cfg.critic (workers/losses.critic_loss_fn)."""
from __future__ import annotations

from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.workers.losses import critic_loss_fn, value_output_fn
from megatron_ppo.workers.role import RoleWorker


class CriticWorker(RoleWorker):
    ROLE = "critic"

    def compute_values(self, batch: RolloutBatch) -> dict | None:
        """{"values": [B, R]} (micro-batches as the old-log-prob pass: rollout.log_prob_*)."""
        r = self.cfg.rollout
        return self.forward_rows(batch, r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz,
                                 r.log_prob_max_token_len_per_gpu, value_output_fn)

    @classmethod
    def update_inputs(cls, cfg, available) -> tuple[str, ...]:
        return ("values", "returns")

    def make_loss(self, mini_batch_tokens: int, mini_batch_seqs: int):
        return critic_loss_fn(self.cfg.critic, mini_batch_tokens=mini_batch_tokens, mini_batch_seqs=mini_batch_seqs)
