"""Where a step's rollouts come from (rollout.mode): ``OnlineSource`` (the actor's rollout engine generates from
prompts) or ``OfflineSource`` (stored trajectories replayed). Driver side: both answer ``len()`` (the rows the
sampler draws from) and ``batch(rows, step) -> RolloutBatch``, so the loop does not branch on the mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.rollout.base import SamplingParams
from megatron_ppo.rollout.offline import OfflineTrajectories, rollout_batch
from megatron_ppo.rollout.stop import ResponseStop

META_KEYS = ("raw_prompt", "data_source", "reward_model", "extra_info", "index")


class RolloutSource(Protocol):
    kind: str  # "online" | "offline"

    def __len__(self) -> int: ...

    def batch(self, rows: list[int], step: int) -> RolloutBatch: ...


def sampling_params(sampling, max_response_length: int, eos_token_ids, pad_token_id: int) -> SamplingParams:
    """Algorithm-level sampling from a rollout (or rollout.val_kwargs) section: what to sample, never how. The seed
    is derived by each replica from trainer.seed and the step (rollout.base.replica_seed)."""
    return SamplingParams(max_response_length=max_response_length,
                          temperature=sampling.temperature if sampling.do_sample else 1.0,
                          top_k=max(sampling.top_k, 0), top_p=sampling.top_p, greedy=not sampling.do_sample,
                          eos_token_ids=tuple(eos_token_ids), pad_token_id=pad_token_id)


class OnlineSource:
    """Prompts (a PromptDataset) answered by the actor group's rollout engine, ``n`` responses per prompt."""

    kind = "online"

    def __init__(self, dataset, actor, params: SamplingParams, n: int, balance: bool = True,
                 stop: ResponseStop | None = None):
        self.dataset, self.actor, self.params, self.n, self.balance = dataset, actor, params, n, balance
        self.stop = stop  # rollout.stop_pattern (rollout/stop.py), applied to every batch the engine returns

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, rows: list[int], step: int) -> RolloutBatch:
        return self.generate(self.dataset.collate(rows), step)

    def generate(self, prompts: dict, step: int) -> RolloutBatch:
        """Responses to collated (left-padded) prompts; rollout log-probs come back with the tokens."""
        rows, prompt_ids = self._expand(prompts)
        out = self.actor.call_rows("generate", {"prompt_ids": prompt_ids}, [int(p.numel()) for p in prompt_ids],
                                   self.params, step, balance=self.balance)
        return self._batch(prompts, rows, prompt_ids, out, step)

    def submit(self, rows: list[int], step: int) -> "PendingRollout":
        """``batch(rows, step)``, started on the actor's engine and left running (trainer.async_rollout=one_step);
        ``collect`` takes it."""
        prompts = self.dataset.collate(rows)
        expanded, prompt_ids = self._expand(prompts)
        shards = self.actor.submit_rows("generate_submit", {"prompt_ids": prompt_ids},
                                        [int(p.numel()) for p in prompt_ids], self.params, step, balance=self.balance)
        return PendingRollout(prompts, expanded, prompt_ids, shards, step)

    def collect(self, pending: "PendingRollout") -> RolloutBatch:
        out = self.actor.collect_rows("generate_collect", pending.shards)
        return self._batch(pending.prompts, pending.rows, pending.prompt_ids, out, pending.step)

    def _expand(self, prompts: dict) -> tuple[list[int], list[torch.Tensor]]:
        """Each prompt ``n`` times (rollout.n), unpadded: generation takes them without the left padding."""
        rows = [i for i in range(len(prompts["raw_prompt"])) for _ in range(self.n)]
        keep = prompts["attention_mask"].bool()
        return rows, [prompts["input_ids"][i][keep[i]] for i in rows]

    def _batch(self, prompts: dict, rows: list[int], prompt_ids: list, out: dict, step: int) -> RolloutBatch:
        responses, lengths, log_probs = out["responses"], out["response_lengths"], out["log_probs"]
        meta = {key: [prompts[key][i] for i in rows] for key in META_KEYS}
        meta["uid"] = [f"{step}-{i}" for i in rows]  # GRPO groups: the n responses to one prompt of this batch
        if self.stop is not None:
            responses, lengths, log_probs, stopped = self.stop.apply(responses, lengths, log_probs,
                                                                     self.params.pad_token_id)
            meta["stopped"] = stopped.tolist()  # counted as response_length/stop_ratio
        mask = (torch.arange(responses.shape[1]) < lengths.unsqueeze(1)).float()
        return RolloutBatch(prompt_ids, responses, mask, {"rollout_log_probs": log_probs * mask}, meta)


@dataclass
class PendingRollout:
    """A rollout in flight (``OnlineSource.submit``): what ``collect`` needs to make its batch."""
    prompts: dict
    rows: list[int]
    prompt_ids: list
    shards: list[list[int]]
    step: int


class OfflineSource:
    """Stored trajectories (rollout.trajectory_files) replayed: no generation."""

    kind = "offline"

    def __init__(self, trajectories: OfflineTrajectories):
        self.trajectories = trajectories

    def __len__(self) -> int:
        return len(self.trajectories)

    def batch(self, rows: list[int], step: int) -> RolloutBatch:
        return rollout_batch(self.trajectories.rows(rows), self.trajectories.pad_token_id, step)
