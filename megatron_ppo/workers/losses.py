"""The per-micro-batch functions the role workers build from their config inside the ranks (the driver sends data,
never functions): outputs (log-probs, values) and losses.

Each binds a model output ([1, T, V/TP] logits or [1, T, 1] values, packed) to the algo/ math in verl's [b, R]
response layout. Losses are normalised by the whole mini-batch (``batch_num_tokens`` / ``global_batch_size``)
so that summing micro-batches, which the schedule does, gives the mini-batch loss.
"""
from __future__ import annotations

import torch

from megatron_ppo.algo.advantages import masked_mean
from megatron_ppo.algo.losses import (agg_loss, compute_policy_loss, compute_policy_loss_bypass, compute_value_loss,
                                     kl_penalty)
from megatron_ppo.models.logprobs import next_token_targets, vocab_parallel_logprobs_entropy
from megatron_ppo.data.batch import at_logit_positions, gather_response


def response_logprobs_entropy(logits, micro: dict, vocab_size: int, temperature: float):
    """Log-probs and entropies of the response tokens, [b, R] each (vocab-parallel over TP).

    logits: [1, N, V/TP] at the micro-batch's ``logit_positions`` (what the actor/reference models return for a
    ``pack_rows`` micro-batch: the log-softmax then runs only there too), or [1, T, V/TP] at every packed position."""
    targets, _ = next_token_targets(micro["input_ids"], micro["cu_seqlens"])
    selected = at_logit_positions(logits.shape[-2], micro)
    if selected:
        targets = targets.reshape(-1)[micro["logit_positions"]].reshape(logits.shape[:-1])
    log_probs, entropy = vocab_parallel_logprobs_entropy(logits, targets, vocab_size=vocab_size,
                                                         temperature=temperature)
    return gather_response(log_probs, micro, selected), gather_response(entropy, micro, selected)


def logprob_output_fn(vocab_size: int, temperature: float):
    def output_fn(logits, micro):
        log_probs, entropy = response_logprobs_entropy(logits, micro, vocab_size, temperature)
        return {"log_probs": log_probs, "entropy": entropy}
    return output_fn


def value_output_fn(values, micro):
    return {"values": gather_response(values[..., 0], micro)}


def reward_output_fn(values, micro):
    """A reward model's score per sequence: the value at its last token (its last response token; resp_pos[t] is
    the position before response token t, so the last one is resp_pos[L - 1] + 1). An empty response scores 0."""
    lengths = micro["response_mask"].sum(1).long()
    last = micro["resp_pos"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1) + 1
    last = torch.where(lengths > 0, last, torch.zeros_like(last))  # (an empty response has no last token)
    scores = values[..., 0].reshape(-1)[last].float()
    return {"scores": torch.where(lengths > 0, scores, torch.zeros_like(scores))}


def actor_loss_fn(actor_cfg, *, vocab_size: int, temperature: float, mini_batch_tokens: int, mini_batch_seqs: int,
                  rollout_correction=None):
    """PPO clip / dual-clip policy loss + entropy bonus + KL loss, IS-weighted when the batch carries weights.

    ``rollout_correction`` (algorithm.rollout_correction) with bypass_mode: the micro-batch's old_log_probs are the
    rollout's and the policy loss is algo.losses.compute_policy_loss_bypass (loss_type ppo_clip | reinforce, IS
    weights / rejection from the current log-prob, rollout_corr/* metrics per micro-batch), as verl."""
    low, high = actor_cfg.clip_bounds()
    agg = {"loss_agg_mode": actor_cfg.loss_agg_mode, "batch_num_tokens": mini_batch_tokens,
           "global_batch_size": mini_batch_seqs, "loss_scale_factor": actor_cfg.loss_scale_factor}
    clip = {"clip_ratio": actor_cfg.clip_ratio, "clip_ratio_low": low, "clip_ratio_high": high,
            "clip_ratio_c": actor_cfg.clip_ratio_c}
    rc = rollout_correction if rollout_correction is not None and rollout_correction.bypass_mode else None

    def policy_loss(log_prob, micro, mask):
        if rc is None:
            return compute_policy_loss(micro["old_log_probs"], log_prob, micro["advantages"], mask,
                                       rollout_is_weights=micro.get("rollout_is_weights"), **clip, **agg)
        return compute_policy_loss_bypass(
            micro["old_log_probs"], log_prob, micro["advantages"], mask, loss_type=rc.loss_type,
            rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold, **clip, **agg)

    def loss_fn(logits, micro):
        mask = micro["loss_mask"]
        log_prob, entropy = response_logprobs_entropy(logits, micro, vocab_size, temperature)
        pg_loss, metrics = policy_loss(log_prob, micro, mask)
        entropy_loss = agg_loss(entropy, mask, **agg)
        loss = pg_loss - actor_cfg.entropy_coeff * entropy_loss
        # k1 (actor/ppo_kl, verl's metric) can be negative; the target-KL guard reads this non-negative k3 estimate.
        ppo_kl_k3 = masked_mean(kl_penalty(log_prob.detach(), micro["old_log_probs"], "low_var_kl"), mask)
        metrics = {**metrics, "actor/entropy": entropy_loss.detach(), "actor/ppo_kl_k3": ppo_kl_k3}
        if actor_cfg.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_probs"], actor_cfg.kl_loss_type, response_mask=mask)
            kl_loss = agg_loss(kld, mask, **agg)
            loss = loss + actor_cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics

    return loss_fn


def critic_loss_fn(critic_cfg, *, mini_batch_tokens: int, mini_batch_seqs: int):
    """Clipped value loss around the rollout-time values."""

    def loss_fn(values, micro):
        vpreds = gather_response(values[..., 0], micro)
        loss, clipfrac = compute_value_loss(
            vpreds, micro["returns"], micro["values"], micro["loss_mask"], critic_cfg.cliprange_value,
            loss_agg_mode=critic_cfg.loss_agg_mode, batch_num_tokens=mini_batch_tokens,
            global_batch_size=mini_batch_seqs)
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac}

    return loss_fn
