"""RewardModelWorker: one score per sequence from a reward model, on one rank of the reward model's layout.

The model is a value-head GPTModel (models/gpt.py, role "reward"), loaded from an HF *ForSequenceClassification
checkpoint (reward.reward_model.model.path: its ``score`` head becomes the value head) or built from an inline arch
(random init: tests). A sequence's score is the value at its last token, the last response token, as HF's
sequence classifiers and verl's reward models read it. Frozen: no optimizer, never checkpointed.
"""
from __future__ import annotations

from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.workers.losses import reward_output_fn
from megatron_ppo.workers.role import RoleWorker


class RewardModelWorker(RoleWorker):
    ROLE = "reward"  # cluster.reward (layout), reward.reward_model.model (roles.py)

    def compute_scores(self, batch: RolloutBatch) -> dict | None:
        """{"scores": [B]} (fp32), in row order; None on a non-last pipeline stage. Micro-batches:
        reward.reward_model.micro_batch_size_per_gpu sequences, or (null) rollout.log_prob_max_token_len_per_gpu
        tokens."""
        size = self.cfg.reward.reward_model.micro_batch_size_per_gpu
        return self.forward_rows(batch, size, size is None, self.cfg.rollout.log_prob_max_token_len_per_gpu,
                                 reward_output_fn, mask=False)
