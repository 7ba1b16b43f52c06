"""The one packer (data/batch.py): packed sequences, cu_seqlens (with per-sequence alignment for TP/SP) and the
response-position map are exact; token-budget micro-batches keep every row within the budget."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ppo.data.batch import (RolloutBatch, gather_response, micro_batches_by_tokens, pack_rows,
                                     packed_num_tokens, chunk_rows)
from megatron_ppo.models.forward import packed_seq_params
from megatron_ppo.models.logprobs import next_token_targets


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
    assert chunk_rows([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="micro-batch size"):
        chunk_rows([0], 0)
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


@st.composite
def rollout_batches(draw):
    """Ragged prompts and responses (empty responses included), a subset of rows in any order, an alignment."""
    size, width = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    prompts = [torch.tensor(draw(st.lists(st.integers(1, 99), min_size=1, max_size=6))) for _ in range(size)]
    lengths = [draw(st.integers(0, width)) for _ in range(size)]
    responses = torch.zeros(size, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        responses[i, :n] = torch.tensor(draw(st.lists(st.integers(100, 199), min_size=n, max_size=n)),
                                        dtype=torch.long)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).float()
    rows = draw(st.permutations(range(size)))[: draw(st.integers(1, size))]
    values = torch.randn(size, width, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))),
                         dtype=torch.float64)
    return RolloutBatch(prompts, responses, mask, {"values": values}), rows, draw(st.sampled_from([1, 2, 3, 8]))


def reference_pack(batch, rows, align):
    """Plain loops: each row's prompt + response, padded with 0 to a multiple of `align`, one after another."""
    ids, cu = [], [0]
    for i in rows:
        n = int(batch.response_mask[i].sum())
        seq = batch.prompt_ids[i].tolist() + batch.responses[i, :n].tolist()
        padded = -(-len(seq) // align) * align
        ids += seq + [0] * (padded - len(seq))
        cu.append(cu[-1] + padded)
    return ids, cu


@settings(max_examples=150, deadline=None)
@given(rollout_batches())
def test_pack_rows_matches_reference_with_alignment(case):
    """Ported from the removed data/packing.PackLayout tests: the packed stream and its padded cu_seqlens equal a
    plain-Python reference at every alignment, T is a multiple of the alignment (sequence parallelism needs it),
    and the response layout maps back exactly, never onto alignment padding or another sequence."""
    batch, rows, align = case
    micro = pack_rows(batch, rows, keys=("values",), align=align)
    ids, cu = reference_pack(batch, rows, align)
    assert micro["input_ids"].tolist() == [ids]
    assert micro["cu_seqlens"].dtype == torch.int32 and micro["cu_seqlens"].tolist() == cu
    total = micro["input_ids"].shape[1]
    lengths = [batch.prompt_ids[i].numel() + int(batch.response_mask[i].sum()) for i in rows]
    assert total % align == 0 and total == packed_num_tokens(lengths, align)
    params = packed_seq_params(micro["cu_seqlens"])
    assert params.qkv_format == "thd" and params.cu_seqlens_q_padded.tolist() == cu
    assert params.max_seqlen_q == max(b - a for a, b in zip(cu, cu[1:]))
    # every response token is the next-token target at its resp_pos (what the losses read) ...
    targets, valid = next_token_targets(micro["input_ids"], micro["cu_seqlens"])
    pos, mask = micro["resp_pos"], micro["response_mask"].bool()
    assert torch.equal(targets.reshape(-1)[pos][mask], batch.responses[rows][mask])
    assert bool(valid.reshape(-1)[pos][mask].all())
    # ... and resp_pos stays on the row's own real tokens, also past the response end
    starts = torch.tensor(cu[:-1]).unsqueeze(1)
    assert bool(((pos >= starts) & (pos < starts + torch.tensor(lengths).unsqueeze(1))).all())
    per_token = torch.randn(1, total, dtype=torch.float64)
    assert torch.equal(gather_response(per_token, micro), per_token[0][pos])
    assert torch.equal(micro["values"], batch.tensors["values"][rows])


def test_bad_alignment_names_it():
    batch = _batch()
    with pytest.raises(ValueError, match="align=0 must be >= 1"):
        pack_rows(batch, [0], align=0)
    with pytest.raises(ValueError, match="align=-2 must be >= 1"):
        packed_num_tokens([3], align=-2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=16),
       st.integers(0, 12), st.sampled_from([1, 4]), st.data())
def test_micro_batches_by_tokens_keep_every_row_within_the_budget(shapes, slack, align, data):
    prompts = [torch.full((p,), 7) for p, _ in shapes]
    width = max(r for _, r in shapes) or 1
    mask = (torch.arange(width) < torch.tensor([r for _, r in shapes]).unsqueeze(1)).float()
    batch = RolloutBatch(prompts, torch.full((len(shapes), width), 8), mask)
    rows = data.draw(st.permutations(range(len(shapes))))[: data.draw(st.integers(1, len(shapes)))]
    longest = max(packed_num_tokens([batch.num_tokens([i])], align) for i in rows)
    budget = longest + slack
    plan = micro_batches_by_tokens(batch, rows, budget, align=align)
    assert sorted(r for micro in plan for r in micro) == sorted(rows)  # every row, exactly once
    for micro in plan:
        assert micro and micro == sorted(micro, key=rows.index)
        assert pack_rows(batch, micro, align=align)["input_ids"].shape[1] <= budget
    assert len(plan) >= -(-packed_num_tokens([batch.num_tokens([i]) for i in rows], align) // budget)


def test_micro_batches_by_tokens_refuses_a_row_over_the_budget():
    batch = _batch()  # rows of 5, 5 and 3 tokens
    assert micro_batches_by_tokens(batch, [0, 1, 2], 8) in ([[0, 2], [1]], [[0], [1, 2]])
    with pytest.raises(ValueError, match=r"row 1 has 5 tokens .* > max_tokens=4"):
        micro_batches_by_tokens(batch, [2, 1], 4)
    with pytest.raises(ValueError, match="no rows"):
        micro_batches_by_tokens(batch, [], 4)
