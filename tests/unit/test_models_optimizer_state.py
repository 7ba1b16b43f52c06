"""models/optimizer_state.py's geometry: a DP rank's flat range of a parameter as boxes of the model-space tensor
(row-major decomposition; megatron's SwiGLU factory, TP offsets and a prepended layer axis), checked element by
element against megatron's own placement of the whole parameter."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_ppo.models.optimizer_state import _boxes, row_major_boxes


@st.composite
def shape_and_range(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@given(shape_and_range())
def test_boxes_cover_the_range_once_in_memory_order_each_contiguous(case):
    shape, start, stop = case
    index = torch.arange(math.prod(shape)).view(shape)
    covered = []
    for offset, size in row_major_boxes(shape, start, stop):
        box = index[tuple(slice(o, o + s) for o, s in zip(offset, size))].reshape(-1)
        assert torch.equal(box, torch.arange(int(box[0]), int(box[0]) + box.numel()))  # a view of one flat run
        covered.append(box)
    got = torch.cat(covered) if covered else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(start, stop))
    assert len(row_major_boxes(shape, start, stop)) <= max(1, 2 * len(shape) - 1)


def _sharded(swiglu: bool, layer_axis: bool):
    """fc1 (gate and up stacked, 2 x 6 rows of 5) as TP rank 1 of 2 holds it, megatron's ShardedTensor or factory."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    local = torch.arange(60, dtype=torch.float32).view(12, 5)
    offsets = ((0, 1, 3),) if layer_axis else ()  # layer 1 of 3, as 0.16.1's stacked layer keys
    sh = ShardedTensor.from_rank_offsets("fc1", local, *offsets, (len(offsets), 1, 2), replica_id=(0, 0, 0),
                                         prepend_axis_num=len(offsets))
    return local, (apply_swiglu_sharded_factory(sh, offsets) if swiglu else sh)


def _place(parts, shape):
    out = torch.full(shape, -1.0)
    for p in parts:
        out[p.global_slice()] = p.data.reshape(out[p.global_slice()].shape)
    return out


@pytest.mark.parametrize("layer_axis", [False, True], ids=["flat", "layer_axis"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["tensor", "swiglu_factory"])
@given(st.integers(0, 60), st.integers(0, 60))
def test_a_shards_boxes_put_each_element_where_megatron_puts_it(swiglu, layer_axis, a, b):
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    start, stop = min(a, b), max(a, b)
    local, sharded = _sharded(swiglu, layer_axis)
    whole = list(nested_values(sharded.build_fn("fc1", local, (0, 0, 0), None))) if swiglu else [sharded]
    reference = _place(whole, whole[0].global_shape)  # megatron's placement of the whole TP-local tensor
    boxes = _boxes(sharded, "k", local.view(-1)[start:stop], start, (0, 0, 0))
    assert all(b.key == "k" and b.axis_fragmentations is None and b.prepend_axis_num == 0 for b in boxes)
    got = _place(boxes, whole[0].global_shape)
    written = got >= 0
    assert int(written.sum()) == stop - start
    assert torch.equal(got[written], reference[written])
    assert torch.equal(torch.sort(got[written]).values, torch.arange(start, stop, dtype=torch.float32))
