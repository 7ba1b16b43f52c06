"""The losses the trainer applies, against an independent float64 hand computation on a packed batch.

Every knob is non-zero at once: entropy bonus, KL loss (each estimator, "+" straight-through variants included),
asymmetric clip and dual-clip, rollout IS weights, a loss mask with holes and a fully rejected row, padded vocab,
temperature. The hand computation works from the per-sequence logits with nothing but log_softmax and the formulas
(no algo/ or models/ function), so a flipped sign, a dropped term or a wrong normaliser in the trainer's loss shows
up as a value or gradient mismatch. The micro-batch split (1, 2, 4 micro-batches of the same mini-batch, losses
summed as the schedule does) must not change the gradient.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_ppo.config import ActorConfig, CriticConfig
from megatron_ppo.data.batch import RolloutBatch, pack_rows, chunk_rows
# The one place that names where the trainer's losses live (they move into the role workers later).
from megatron_ppo.workers.losses import actor_loss_fn, critic_loss_fn

VOCAB, PADDED = 7, 8  # one padded vocab column: it must get no gradient
PROMPTS = (2, 3, 1, 4)
LENGTHS = (3, 5, 2, 4)  # response lengths; R = 5
R = max(LENGTHS)
TEMPERATURE = 0.7
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "abs+", "k2+", "low_var_kl+", "k3+")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 2.0


def _batch(seed: int = 0) -> tuple[RolloutBatch, list[torch.Tensor]]:
    """Rows with different prompt/response lengths, per-sequence logits leaves [P + L, PADDED] (float64), and
    old log-probs chosen so that the tokens fall in every clip region (checked by the hand computation)."""
    g = torch.Generator().manual_seed(seed)
    B = len(PROMPTS)
    prompt_ids = [torch.randint(0, VOCAB, (p,), generator=g) for p in PROMPTS]
    responses = torch.randint(0, VOCAB, (B, R), generator=g)
    response_mask = (torch.arange(R)[None] < torch.tensor(LENGTHS)[:, None]).float()
    loss_mask = response_mask.clone()
    loss_mask[1, 2] = 0.0  # a hole inside a response (a rejected token)
    loss_mask[0, 0] = 0.0  # and one at its start
    loss_mask[2] = 0.0  # a fully rejected row: still a row of the mini-batch
    logits = [(2.5 * torch.randn(p + n, PADDED, generator=g, dtype=torch.float64)).requires_grad_(True)
              for p, n in zip(PROMPTS, LENGTHS)]
    with torch.no_grad():
        cur = _hand_logprobs_entropy(logits, prompt_ids, responses)[0]
    # log-ratios spread over [-1.4, 1.4]: below 1 - low, inside, above 1 + high, above clip_ratio_c = 2
    shift = torch.linspace(-1.4, 1.4, B * R, dtype=torch.float64)[torch.randperm(B * R, generator=g)].view(B, R)
    advantages = torch.randn(B, R, generator=g, dtype=torch.float64)
    for (i, j), (log_ratio, sign) in {(3, 1): (1.2, -1), (3, 2): (0.5, 1), (1, 3): (-0.9, 1), (0, 2): (0.9, -1),
                                      (1, 4): (-0.05, 1)}.items():
        shift[i, j], advantages[i, j] = log_ratio, sign * advantages[i, j].abs()  # dual, clipped high/low, inside
    old = cur - shift
    ref = cur + 0.6 * torch.randn(B, R, generator=g, dtype=torch.float64)
    weights = 0.2 + 1.6 * torch.rand(B, R, generator=g, dtype=torch.float64)
    values = torch.randn(B, R, generator=g, dtype=torch.float64)
    returns = values + torch.randn(B, R, generator=g, dtype=torch.float64)
    batch = RolloutBatch(prompt_ids, responses, response_mask, tensors={
        "old_log_probs": old, "advantages": advantages, "ref_log_probs": ref, "rollout_is_weights": weights,
        "loss_mask": loss_mask, "values": values, "returns": returns})
    return batch, logits


def _hand_logprobs_entropy(logits, prompt_ids, responses):
    """[B, R] log-prob and entropy of each response token, from its own sequence's logits (0 past the end)."""
    rows_logp, rows_ent = [], []
    for i, seq_logits in enumerate(logits):
        p = prompt_ids[i].numel()
        lp_row, ent_row = [], []
        for j in range(R):
            if j < LENGTHS[i]:
                z = seq_logits[p + j - 1, :VOCAB] / TEMPERATURE  # position p+j-1 predicts response token j
                log_softmax = z - torch.logsumexp(z, 0)
                lp_row.append(log_softmax[responses[i, j]])
                ent_row.append(-(log_softmax.exp() * log_softmax).sum())
            else:
                lp_row.append(torch.zeros((), dtype=torch.float64))
                ent_row.append(torch.zeros((), dtype=torch.float64))
        rows_logp.append(torch.stack(lp_row))
        rows_ent.append(torch.stack(ent_row))
    return torch.stack(rows_logp), torch.stack(rows_ent)


def _hand_agg(mat, mask, mode, tokens, seqs):
    """The documented aggregation: token-mean over the mini-batch's tokens, seq-mean over its rows."""
    total = (mat * mask).sum()
    if mode == "token-mean":
        return total / tokens
    if mode == "token-sum":
        return total
    per_seq = (mat * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    loss = per_seq.sum() / seqs
    return loss / R if mode == "seq-mean-token-sum-norm" else loss


def _hand_kl(logp, ref, kind):
    base, straight = kind.rstrip("+"), kind.endswith("+")
    d = logp - ref
    if base in ("kl", "k1"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * d * d
    else:  # k3: r - log r - 1 with r = p_ref / p
        value = torch.exp(-d) + d - 1
    if not straight:
        return value
    k2 = 0.5 * d * d  # value of the named estimator, gradient of k2
    return value.detach() + k2 - k2.detach()


def _hand_actor_loss(logits, batch, rows, *, entropy_coeff, kl_coef, kl_type, agg, seqs=None):
    t = batch.tensors
    logp, ent = _hand_logprobs_entropy([logits[i] for i in rows], [batch.prompt_ids[i] for i in rows],
                                       batch.responses[rows])
    mask = t["loss_mask"][rows].double()
    tokens = mask.sum()
    seqs = len(rows) if seqs is None else seqs
    old, adv, w = t["old_log_probs"][rows], t["advantages"][rows], t["rollout_is_weights"][rows]
    ratio = torch.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH)
    ppo = torch.maximum(unclipped, clipped)
    dual = -adv * CLIP_C
    pg = torch.where(adv < 0, torch.minimum(ppo, dual), ppo) * w
    valid = mask.bool()
    regions = {"clipped": (clipped > unclipped) & valid, "unclipped": (clipped < unclipped) & valid,
               "dual": (adv < 0) & (ppo > dual) & valid}
    loss = (_hand_agg(pg, mask, agg, tokens, seqs) - entropy_coeff * _hand_agg(ent, mask, agg, tokens, seqs)
            + kl_coef * _hand_agg(_hand_kl(logp, t["ref_log_probs"][rows], kl_type), mask, agg, tokens, seqs))
    return loss, regions


def _packed_logits(logits, rows):
    return torch.cat([logits[i] for i in rows]).unsqueeze(0)  # [1, T, PADDED], the packing of pack_rows


def _trainer_actor_loss(logits, batch, micro_sizes, cfg, mini_tokens, mini_seqs):
    loss_fn = actor_loss_fn(cfg, vocab_size=VOCAB, temperature=TEMPERATURE, mini_batch_tokens=mini_tokens,
                            mini_batch_seqs=mini_seqs)
    keys = ("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights")
    total, metrics = 0, []
    for rows in micro_sizes:
        micro = pack_rows(batch, rows, keys)
        loss, m = loss_fn(_packed_logits(logits, rows), micro)
        total = total + loss
        metrics.append(m)
    return total, metrics


def _actor_cfg(**kw):
    return ActorConfig(clip_ratio=0.5, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
                       **kw)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=False)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_actor_loss_matches_hand_computation_for_every_kl_estimator(kl_type):
    batch, logits = _batch()
    rows = list(range(batch.size))
    cfg = _actor_cfg(entropy_coeff=0.13, use_kl_loss=True, kl_loss_coef=0.37, kl_loss_type=kl_type)
    tokens = int(batch.loss_mask.sum())
    loss, metrics = _trainer_actor_loss(logits, batch, [rows], cfg, tokens, len(rows))
    expected, regions = _hand_actor_loss(logits, batch, rows, entropy_coeff=0.13, kl_coef=0.37, kl_type=kl_type,
                                         agg="token-mean")
    for name, where in regions.items():  # the batch exercises every branch of the clipped objective
        assert where.any(), f"no token in the {name} region: the test batch lost its coverage"
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    for got, want in zip(_grads(loss, logits), _grads(expected, logits)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        assert got[:, VOCAB:].abs().max() == 0
    assert "actor/kl_loss" in metrics[0] and "actor/entropy" in metrics[0]


def test_each_term_moves_the_loss_in_its_documented_direction():
    """The entropy bonus lowers the loss by coeff x entropy, the KL loss raises it by coef x KL (k1 here, whose
    value can be either sign: checked against its own value)."""
    batch, logits = _batch(1)
    rows = list(range(batch.size))
    tokens = int(batch.loss_mask.sum())
    base, _ = _trainer_actor_loss(logits, batch, [rows], _actor_cfg(), tokens, len(rows))
    with_ent, m = _trainer_actor_loss(logits, batch, [rows], _actor_cfg(entropy_coeff=0.5), tokens, len(rows))
    entropy = m[0]["actor/entropy"]
    assert entropy > 0
    torch.testing.assert_close(with_ent, base - 0.5 * entropy)
    with_kl, m = _trainer_actor_loss(logits, batch, [rows], _actor_cfg(use_kl_loss=True, kl_loss_coef=2.0,
                                                                       kl_loss_type="low_var_kl"), tokens, len(rows))
    assert m[0]["actor/kl_loss"] > 0
    torch.testing.assert_close(with_kl, base + 2.0 * m[0]["actor/kl_loss"])


@pytest.mark.parametrize("agg", AGG_MODES)
def test_actor_loss_every_aggregation_and_micro_batch_split_gives_the_same_gradient(agg):
    batch, logits = _batch(2)
    rows = list(range(batch.size))
    cfg = _actor_cfg(entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k3+", loss_agg_mode=agg)
    tokens = int(batch.loss_mask.sum())
    expected, _ = _hand_actor_loss(logits, batch, rows, entropy_coeff=0.05, kl_coef=0.2, kl_type="k3+", agg=agg)
    want = _grads(expected, logits)
    for size in (4, 2, 1):
        loss, _ = _trainer_actor_loss(logits, batch, chunk_rows(rows, size), cfg, tokens, len(rows))
        torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12, msg=f"{agg}, micro size {size}")
        for got, ref in zip(_grads(loss, logits), want):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12, msg=f"{agg}, micro size {size}")


def test_actor_loss_without_weights_or_kl_is_the_plain_clipped_objective():
    """No IS weights in the micro-batch: weight 1 (the trainer only passes the key when correction ran)."""
    batch, logits = _batch(3)
    rows = list(range(batch.size))
    batch.tensors["rollout_is_weights"] = torch.ones_like(batch.tensors["rollout_is_weights"])
    expected, _ = _hand_actor_loss(logits, batch, rows, entropy_coeff=0.0, kl_coef=0.0, kl_type="kl",
                                   agg="token-mean")
    loss_fn = actor_loss_fn(_actor_cfg(), vocab_size=VOCAB, temperature=TEMPERATURE,
                            mini_batch_tokens=int(batch.loss_mask.sum()), mini_batch_seqs=len(rows))
    loss, metrics = loss_fn(_packed_logits(logits, rows), pack_rows(batch, rows, ("old_log_probs", "advantages")))
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    assert "actor/kl_loss" not in metrics


# ------------------------------------------------------------------------------------------------------- critic


def _hand_critic_loss(values, batch, rows, clip, agg):
    t = batch.tensors
    vpreds = torch.stack([
        torch.stack([values[i][PROMPTS[i] + j - 1, 0] if j < LENGTHS[i] else torch.zeros((), dtype=torch.float64)
                     for j in range(R)]) for i in rows])
    mask = t["loss_mask"][rows].double()
    old, ret = t["values"][rows], t["returns"][rows]
    clipped_v = torch.minimum(torch.maximum(vpreds, old - clip), old + clip)
    unclipped_l, clipped_l = (vpreds - ret) ** 2, (clipped_v - ret) ** 2
    both = mask.bool()
    assert ((clipped_l > unclipped_l) & both).any() and ((clipped_l < unclipped_l) & both).any()
    return 0.5 * _hand_agg(torch.maximum(unclipped_l, clipped_l), mask, agg, mask.sum(), len(rows))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_critic_loss_matches_hand_computation_for_every_split(agg):
    batch, _ = _batch(4)
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(p + n, 1, generator=g, dtype=torch.float64).requires_grad_(True)
              for p, n in zip(PROMPTS, LENGTHS)]
    rows = list(range(batch.size))
    expected = _hand_critic_loss(values, batch, rows, 0.3, agg)
    want = _grads(expected, values)
    loss_fn = critic_loss_fn(CriticConfig(cliprange_value=0.3, loss_agg_mode=agg),
                             mini_batch_tokens=int(batch.loss_mask.sum()), mini_batch_seqs=len(rows))
    for size in (4, 2, 1):
        total = 0
        for micro_rows in chunk_rows(rows, size):
            loss, metrics = loss_fn(_packed_logits(values, micro_rows), pack_rows(batch, micro_rows,
                                                                                   ("values", "returns")))
            total = total + loss
        torch.testing.assert_close(total, expected, rtol=1e-10, atol=1e-12, msg=f"{agg}, micro size {size}")
        for got, ref in zip(_grads(total, values), want):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    assert math.isfinite(float(metrics["critic/vf_clipfrac"]))
