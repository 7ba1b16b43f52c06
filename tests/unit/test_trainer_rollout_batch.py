"""Packed micro-batches of the driver: sequences, cu_seqlens and the response-position map are exact."""
import pytest
import torch

from megatron_ppo.trainer.rollout_batch import RolloutBatch, gather_response, pack_rows, split_rows


def _batch():
    prompts = [torch.tensor([11, 12, 13]), torch.tensor([21]), torch.tensor([31, 32])]
    responses = torch.tensor([[101, 102, 0, 0], [201, 202, 203, 204], [301, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    adv = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return RolloutBatch(prompts, responses, mask, {"advantages": adv})


def test_pack_rows_layout_and_response_positions():
    batch = _batch()
    micro = pack_rows(batch, [2, 0], keys=("advantages",))
    assert micro["input_ids"].tolist() == [[31, 32, 301, 11, 12, 13, 101, 102]]
    assert micro["cu_seqlens"].tolist() == [0, 3, 8]
    # position p predicts token p + 1: row 2's first response token (index 2) is predicted at 1
    assert micro["resp_pos"][0, 0].item() == 1
    assert micro["resp_pos"][1, :2].tolist() == [5, 6]
    ids = micro["input_ids"].reshape(-1)
    predicted = ids[(micro["resp_pos"] + 1).clamp(max=ids.numel() - 1)]
    mask = micro["response_mask"].bool()
    assert predicted[mask].tolist() == [301, 101, 102]
    # positions never leave their own sequence, even past the response end
    starts, ends = torch.tensor([0, 3]), torch.tensor([3, 8])
    assert bool(((micro["resp_pos"] >= starts[:, None]) & (micro["resp_pos"] < ends[:, None])).all())
    assert micro["advantages"].tolist() == [batch.tensors["advantages"][2].tolist(), batch.tensors["advantages"][0].tolist()]


def test_gather_response_reads_the_packed_row():
    batch = _batch()
    micro = pack_rows(batch, [0, 1, 2])
    per_token = torch.arange(micro["input_ids"].numel(), dtype=torch.float32).unsqueeze(0)
    assert torch.equal(gather_response(per_token, micro), micro["resp_pos"].float())


def test_num_tokens_and_split_rows():
    batch = _batch()
    assert batch.num_tokens([0, 1, 2]) == (3 + 2) + (1 + 4) + (2 + 1)
    assert split_rows([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro-batch size"):
        split_rows([0], 0)
    with pytest.raises(ValueError, match="no rows"):
        pack_rows(batch, [])


def test_rejected_tokens_leave_the_loss_mask_but_not_the_packed_sequence():
    """Token-level rejection punches holes in what losses count; the response itself (lengths, packing, the
    position of every later token) must not change."""
    batch = _batch()
    loss_mask = batch.response_mask.clone()
    loss_mask[1, 1] = 0  # reject the second token of row 1 (a hole inside its response)
    batch.tensors["loss_mask"] = loss_mask
    assert batch.response_lengths.tolist() == [2, 4, 1]
    micro = pack_rows(batch, [1])
    assert micro["input_ids"].tolist() == [[21, 201, 202, 203, 204]]
    assert micro["response_mask"].tolist() == [[1, 1, 1, 1]]
    assert micro["loss_mask"].tolist() == [[1, 0, 1, 1]]
    assert micro["resp_pos"].tolist() == [[0, 1, 2, 3]]
