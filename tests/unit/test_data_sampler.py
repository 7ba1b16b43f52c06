"""StatefulSampler: deterministic epochs, drop_last semantics, in-process state round trips at every step."""
import pytest

from megatron_ppo.data.sampler import StatefulSampler


def _run(sampler, steps):
    return [sampler.next_batch() for _ in range(steps)]


@pytest.mark.parametrize("num_rows,batch_size,drop_last", [(10, 3, True), (10, 3, False), (12, 4, True), (7, 7, True)])
def test_epochs_cover_rows_exactly(num_rows, batch_size, drop_last):
    s = StatefulSampler(num_rows, batch_size, seed=5, drop_last=drop_last)
    for epoch in range(3):
        batches = list(s.epoch_batches())
        assert len(batches) == s.batches_per_epoch
        flat = [i for b in batches for i in b]
        order = s.epoch_order(epoch).tolist()
        assert sorted(order) == list(range(num_rows))
        kept = num_rows - (num_rows % batch_size if drop_last else 0)
        assert flat == order[:kept]  # each row at most once; a dropped tail only with drop_last
        assert all(len(b) == batch_size for b in batches[:-1]) and 1 <= len(batches[-1]) <= batch_size
        assert s.epoch == epoch + 1 and s.position == 0


def test_order_depends_on_seed_and_epoch_only():
    a, b = StatefulSampler(50, 5, seed=1), StatefulSampler(50, 5, seed=1)
    assert _run(a, 25) == _run(b, 25)
    assert a.epoch_order(0).tolist() != a.epoch_order(1).tolist()
    assert StatefulSampler(50, 5, seed=2).epoch_order(0).tolist() != a.epoch_order(0).tolist()
    assert StatefulSampler(6, 2, shuffle=False).next_batch() == [0, 1]


@pytest.mark.parametrize("drop_last", [True, False])
def test_restore_at_every_step_matches_uninterrupted(drop_last):
    reference = _run(StatefulSampler(11, 4, seed=3, drop_last=drop_last), 12)
    for k in range(12):
        first = StatefulSampler(11, 4, seed=3, drop_last=drop_last)
        head = _run(first, k)
        resumed = StatefulSampler(11, 4, seed=999, drop_last=drop_last)  # the state's seed wins
        resumed.load_state_dict(first.state_dict())
        assert head + _run(resumed, 12 - k) == reference, k


def test_state_at_epoch_edge_points_to_next_epoch():
    s = StatefulSampler(8, 4, seed=0)
    _run(s, 2)
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 0


def test_bad_state_and_arguments():
    s = StatefulSampler(10, 2)
    with pytest.raises(ValueError, match="num_rows=12 was saved but this sampler has num_rows=10"):
        s.load_state_dict({**s.state_dict(), "num_rows": 12})
    with pytest.raises(KeyError, match="missing key 'position'"):
        s.load_state_dict({"epoch": 0, "seed": 1})
    with pytest.raises(ValueError, match="position=10 out of range"):
        s.load_state_dict({"epoch": 0, "position": 10, "seed": 1})
    with pytest.raises(ValueError, match="data.train_batch_size=11 > the 10 prompts"):
        StatefulSampler(10, 11)
    with pytest.raises(ValueError, match="num_rows=0"):
        StatefulSampler(0, 1)
