"""actor_loss_fn in bypass mode (algorithm.rollout_correction.bypass_mode) on a packed batch, against verl 0.9.1's
own loss pieces on the hand-computed log-probs: compute_policy_loss_bypass_mode for the policy term (effective,
rejection-masked tokens) plus the entropy bonus and KL loss on the response mask (verl's ppo_loss), every
normaliser the mini-batch's count before rejection. Micro-batch splits leave the loss and gradient unchanged
(token-level IS / rejection are per token, sequence-level per row)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

from megatron_ppo.config import RolloutCorrectionConfig  # noqa: E402
from megatron_ppo.data.batch import pack_rows, chunk_rows  # noqa: E402
from megatron_ppo.workers.losses import actor_loss_fn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_losses import (CLIP_C, CLIP_HIGH, CLIP_LOW, TEMPERATURE, VOCAB, _actor_cfg, _batch,  # noqa: E402
                                 _hand_logprobs_entropy, _packed_logits)

KEYS = ("old_log_probs", "advantages", "ref_log_probs")


def _bypass_batch(seed):
    """test_trainer_losses' batch as bypass mode sees it: old log-probs are the rollout's, no IS weights from the
    driver, the loss mask is the response mask (rejection happens in the loss)."""
    batch, logits = _batch(seed)
    del batch.tensors["rollout_is_weights"]
    batch.tensors["loss_mask"] = batch.response_mask.clone()
    return batch, logits


def _verl_loss(logits, batch, rows, rc: dict, cfg, tokens, seqs):
    logp, ent = _hand_logprobs_entropy([logits[i] for i in rows], [batch.prompt_ids[i] for i in rows],
                                       batch.responses[rows])
    mask = batch.response_mask[rows].double()
    info = dict(batch_num_tokens=tokens, global_batch_size=seqs, dp_size=1, loss_scale_factor=None)
    config = OmegaConf.create(dict(clip_ratio=cfg.clip_ratio, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH,
                                   clip_ratio_c=CLIP_C, global_batch_info=info,
                                   policy_loss={"loss_mode": "bypass_mode", "rollout_correction": rc}))
    pg, metrics = core_algos.compute_policy_loss_bypass_mode(batch.tensors["old_log_probs"][rows], logp,
                                                             batch.tensors["advantages"][rows], mask,
                                                             loss_agg_mode=cfg.loss_agg_mode, config=config)
    entropy = core_algos.agg_loss(ent, mask, cfg.loss_agg_mode, **info)
    kld = core_algos.kl_penalty(logp, batch.tensors["ref_log_probs"][rows], cfg.kl_loss_type)
    kl = core_algos.agg_loss(kld, mask, cfg.loss_agg_mode, **info)
    return pg - cfg.entropy_coeff * entropy + cfg.kl_loss_coef * kl, metrics


def _ours(logits, batch, micro_rows, cfg, rc: dict, tokens, seqs):
    loss_fn = actor_loss_fn(cfg, vocab_size=VOCAB, temperature=TEMPERATURE, mini_batch_tokens=tokens,
                            mini_batch_seqs=seqs, rollout_correction=RolloutCorrectionConfig(bypass_mode=True, **rc))
    total, metrics = 0, []
    for rows in micro_rows:
        loss, m = loss_fn(_packed_logits(logits, rows), pack_rows(batch, rows, KEYS))
        total, metrics = total + loss, metrics + [m]
    return total, metrics


RC = {
    "ppo_clip": {"loss_type": "ppo_clip"},
    "ppo_clip_is_rs": {"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": 1.5,
                       "rollout_rs": "token_k1", "rollout_rs_threshold": 2.5},
    "reinforce_token_is": {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5},
    "reinforce_seq_is_rs": {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 3.0,
                            "rollout_rs": "token_k2", "rollout_rs_threshold": 0.3},
}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name", list(RC))
def test_bypass_actor_loss_matches_verl_and_every_micro_batch_split(name, agg):
    rc = RC[name]
    batch, logits = _bypass_batch(4)
    rows = list(range(batch.size))
    cfg = _actor_cfg(entropy_coeff=0.07, use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="low_var_kl",
                     loss_agg_mode=agg)
    tokens, seqs = int(batch.response_mask.sum()), len(rows)
    expected, verl_metrics = _verl_loss(logits, batch, rows, rc, cfg, tokens, seqs)
    want = torch.autograd.grad(expected, logits)
    for size in (4, 2, 1):
        loss, metrics = _ours(logits, batch, chunk_rows(rows, size), cfg, rc, tokens, seqs)
        torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12, msg=f"{name} {agg} micro size {size}")
        for got, ref in zip(torch.autograd.grad(loss, logits), want):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12, msg=f"{name} {agg} micro size {size}")
        # verl's bypass metric names, per micro-batch (the worker averages them weighted by tokens)
        assert set(verl_metrics) <= set(metrics[0]), set(verl_metrics) - set(metrics[0])
    one, metrics = _ours(logits, batch, [rows], cfg, rc, tokens, seqs)
    for key, value in verl_metrics.items():
        assert float(metrics[0][key]) == pytest.approx(value, rel=1e-6, abs=1e-7), key
    if "rollout_rs" in rc:  # the batch really rejects tokens and really weights them
        assert 0 < float(metrics[0]["rollout_corr/rollout_rs_masked_fraction"]) < 1
    if "rollout_is" in rc:
        assert float(metrics[0]["rollout_corr/rollout_is_max"]) > 1.2


def test_without_bypass_the_rollout_correction_config_changes_nothing():
    """bypass_mode=false (decoupled): the loss is the recomputed-old-log-prob PPO loss, whatever loss_type says
    (config validation refuses reinforce there; the loss function does not look)."""
    batch, logits = _bypass_batch(5)
    rows = list(range(batch.size))
    cfg = _actor_cfg()
    tokens = int(batch.response_mask.sum())
    plain = actor_loss_fn(cfg, vocab_size=VOCAB, temperature=TEMPERATURE, mini_batch_tokens=tokens,
                          mini_batch_seqs=len(rows))
    off = actor_loss_fn(cfg, vocab_size=VOCAB, temperature=TEMPERATURE, mini_batch_tokens=tokens,
                        mini_batch_seqs=len(rows),
                        rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1",
                                                                   rollout_rs_threshold=1.1))
    micro = pack_rows(batch, rows, KEYS)
    (a, ma), (b, mb) = plain(_packed_logits(logits, rows), micro), off(_packed_logits(logits, rows), micro)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert set(ma) == set(mb) and not any(k.startswith("rollout_corr/") for k in mb)
