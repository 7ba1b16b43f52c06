"""RewardModelWorker: one score per sequence from a reward model, on one rank of the reward model's layout.

The model is a value-head GPTModel (models/gpt.py, role "reward"), loaded from an HF *ForSequenceClassification
checkpoint (reward.reward_model.model.path: its ``score`` head becomes the value head) or built from an inline arch
(random init: tests). A sequence's score is the value at its last token, the last response token, as HF's
sequence classifiers and verl's reward models read it. Frozen: no optimizer, never checkpointed.
"""
from __future__ import annotations

import torch

from megatron_ppo.data.batch import pack_rows
from megatron_ppo.trainer.losses import reward_output_fn
from megatron_ppo.workers.payload import from_payload
from megatron_ppo.workers.role import RoleWorker


class RewardModelWorker(RoleWorker):
    ROLE = "reward"  # cluster.reward (layout), cfg.model_for("reward") = reward.reward_model.model
    MODEL_ROLE = "reward"
    TRAINABLE = False

    def compute_scores(self, payload: dict) -> dict | None:
        """{"scores": [B]} (fp32), in row order; None on a non-last pipeline stage. Micro-batches:
        reward.reward_model.micro_batch_size_per_gpu sequences, or (null) rollout.log_prob_max_token_len_per_gpu
        tokens."""
        batch = from_payload(payload)
        size = self.cfg.reward.reward_model.micro_batch_size_per_gpu
        groups = self.micro_rows(batch, list(range(batch.size)), size, size is None,
                                 self.cfg.rollout.log_prob_max_token_len_per_gpu)
        outputs = self.forward([pack_rows(batch, g, align=self.align) for g in groups], reward_output_fn)
        if not outputs:
            return None
        order = torch.argsort(torch.as_tensor([r for g in groups for r in g]))
        return {"scores": torch.cat([o["scores"] for o in outputs])[order]}
