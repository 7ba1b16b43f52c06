"""Offline PPO's trajectories: parquet rows sampled like prompts, checked against the actor, turned into rollout
batches (rollout/source.OfflineSource).

No generation: the stored responses and their `rollout_log_probs` are the behaviour policy; the driver recomputes
the old log-probs with the current actor and rollout correction (algorithm.rollout_correction) weights the policy
loss. Rows are checked against the actor before training: token ids outside the actor's vocabulary, a tokenizer
fingerprint other than the actor's (stored by TrajectoryWriter), prompts or responses longer than the configured
lengths, a behaviour temperature other than rollout.temperature (the old log-probs are recomputed at
rollout.temperature, so IS ratios would compare two different distributions) are refused with the file and row;
nothing is re-tokenised or truncated.
"""
from __future__ import annotations

import torch

from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.data.trajectory import TrajectoryDataset, TrajectoryError, tokenizer_fingerprint

def check_rows(items: list[dict], vocab_size: int, fingerprint: str | None, max_prompt_length: int,
               max_response_length: int, temperature: float | None = None) -> None:
    """Refuse the first row the actor cannot train on, naming its file and row (TrajectoryError). ``temperature``
    (rollout.temperature): a row whose behaviour_policy.temperature differs is refused; rows without one pass."""
    for it in items:
        where = it["source"]
        stored_t = (it.get("behaviour_policy") or {}).get("temperature")
        if temperature is not None and stored_t is not None and abs(stored_t - temperature) > 1e-6:
            raise TrajectoryError(f"{where}: behaviour_policy.temperature is {stored_t:g}, rollout.temperature is "
                                  f"{temperature:g}; the actor scores the stored tokens at rollout.temperature, so "
                                  f"set rollout.temperature={stored_t:g} (IS ratios would compare two distributions)")
        stored = it.get("tokenizer")
        if stored is not None and fingerprint is not None and stored != fingerprint:
            raise TrajectoryError(f"{where}: written with tokenizer {stored[:12]}, the actor's is {fingerprint[:12]} "
                                  "(token ids would mean other text); dump the trajectories with this tokenizer")
        for column, limit in (("prompt_ids", max_prompt_length), ("response_ids", max_response_length)):
            ids = it[column]
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise TrajectoryError(f"{where}: column {column!r} holds token id {bad[0]}, outside the actor's "
                                      f"vocabulary [0, {vocab_size}) (another tokenizer's ids?)")
            if len(ids) > limit:
                key = "data.max_prompt_length" if column == "prompt_ids" else "data.max_response_length"
                raise TrajectoryError(f"{where}: column {column!r} has {len(ids)} tokens > {key}={limit}; raise it "
                                      "(trajectories are never truncated)")


class OfflineTrajectories:
    """The offline train rows: `len()` rows and `rows(indices)`, so the sampler is the same for both modes."""

    def __init__(self, files, tokenizer, vocab_size: int, max_prompt_length: int, max_response_length: int,
                 temperature: float | None = None):
        self.dataset = TrajectoryDataset(files, tokenizer, empty_response_policy="error")
        check_rows(self.dataset.items, vocab_size, tokenizer_fingerprint(tokenizer), max_prompt_length,
                   max_response_length, temperature)
        self.pad_token_id = tokenizer.pad_token_id

    def __len__(self) -> int:
        return len(self.dataset)

    def rows(self, indices) -> list[dict]:
        return [self.dataset[i] for i in indices]


def rollout_batch(items: list[dict], pad_token_id: int, step: int) -> RolloutBatch:
    """Stored trajectories as a RolloutBatch: responses right-padded, rollout_log_probs from the file,
    `stored_reward` (per row, None = score it) in meta."""
    width = max(len(it["response_ids"]) for it in items)
    responses = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    logp = torch.zeros(len(items), width)
    mask = torch.zeros(len(items), width)
    for i, it in enumerate(items):
        n = len(it["response_ids"])
        responses[i, :n] = torch.as_tensor(it["response_ids"], dtype=torch.long)
        logp[i, :n] = torch.as_tensor(it["rollout_log_probs"])
        mask[i, :n] = 1.0
    prompt_ids = [torch.as_tensor(it["prompt_ids"], dtype=torch.long) for it in items]
    meta = {"raw_prompt": [it["raw_prompt"] for it in items], "data_source": [it["data_source"] for it in items],
            "reward_model": [it["reward_model"] for it in items], "extra_info": [it["extra_info"] for it in items],
            "index": [it["source"] for it in items], "uid": [f"{step}-{i}" for i in range(len(items))],
            "stored_reward": [it["reward"] for it in items]}
    return RolloutBatch(prompt_ids, responses, mask, {"rollout_log_probs": logp}, meta)
