"""A rollout batch as the plain dict that crosses the driver -> rank boundary (``select_rows`` splits it by row
over DP replicas; ``restore_rows`` puts per-row answers back in order), and back into a ``RolloutBatch``."""
from __future__ import annotations

from megatron_ppo.data.batch import RolloutBatch


def to_payload(batch: RolloutBatch, keys=()) -> dict:
    """Token ids, masks and the per-token ``keys`` (the loss mask too, once rejection wrote one); no meta."""
    keys = tuple(keys) + (("loss_mask",) if "loss_mask" in batch.tensors else ())
    return {"prompt_ids": list(batch.prompt_ids), "responses": batch.responses, "response_mask": batch.response_mask,
            "tensors": {key: batch.tensors[key] for key in dict.fromkeys(keys)}}


def from_payload(payload: dict) -> RolloutBatch:
    return RolloutBatch(list(payload["prompt_ids"]), payload["responses"], payload["response_mask"],
                        dict(payload["tensors"]))


def row_lengths(batch: RolloutBatch) -> list[int]:
    """Tokens per row (prompt + response): the weights of the DP split."""
    lengths = batch.response_lengths.tolist()
    return [int(p.numel()) + int(n) for p, n in zip(batch.prompt_ids, lengths)]
