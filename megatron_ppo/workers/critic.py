"""CriticWorker: values of the responses and the clipped value-loss update, on one rank of the critic's layout.
The loss is built here from cfg.critic (trainer/losses.critic_loss_fn)."""
from __future__ import annotations

from megatron_ppo.trainer.losses import critic_loss_fn, value_output_fn
from megatron_ppo.workers.payload import from_payload
from megatron_ppo.workers.role import RoleWorker


class CriticWorker(RoleWorker):
    ROLE = "critic"
    MODEL_ROLE = "critic"

    def compute_values(self, payload: dict) -> dict | None:
        """{"values": [B, R]} (micro-batches as the old-log-prob pass: rollout.log_prob_*)."""
        r = self.cfg.rollout
        return self.forward_rows(from_payload(payload), r.log_prob_micro_batch_size_per_gpu,
                                 r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu, value_output_fn)

    def update(self, payload: dict, step: int) -> dict:
        c = self.cfg.critic
        return self.run_update(from_payload(payload), step, ("values", "returns"),
                               lambda tokens, seqs: critic_loss_fn(c, mini_batch_tokens=tokens, mini_batch_seqs=seqs))
