"""parallel/transfer.py: what a worker hands back to the driver is on the CPU, whatever device it computed on.

The device side ran for the first time on the GPU check (a PPO step stopped at a cuda tensor meeting a CPU one);
here the "meta" device stands in for the GPU: every tensor of a nested result must move, nothing else may change."""
from collections import namedtuple

import torch

from megatron_ppo.parallel.transfer import to_device, to_host

Pair = namedtuple("Pair", "a b")


def _nested():
    return {"x": torch.ones(2), "rows": [torch.zeros(3), 7, "s"], "pair": Pair(torch.arange(2), None),
            "t": (torch.ones(1), 1.5), "none": None}


def _devices(obj):
    if isinstance(obj, torch.Tensor):
        return [obj.device.type]
    if isinstance(obj, dict):
        return [d for v in obj.values() for d in _devices(v)]
    if isinstance(obj, (list, tuple)):
        return [d for v in obj for d in _devices(v)]
    return []


def test_every_tensor_moves_and_nothing_else_changes():
    moved = to_device(_nested(), "meta")
    assert _devices(moved) == ["meta"] * 4
    assert moved["rows"][1:] == [7, "s"] and moved["none"] is None and moved["t"][1] == 1.5
    assert isinstance(moved["pair"], Pair) and moved["pair"].b is None and isinstance(moved["t"], tuple)
    assert moved["x"].shape == (2,) and moved["rows"][0].shape == (3,)


def test_to_host_brings_every_tensor_back_with_its_values():
    src = _nested()
    host = to_host(src)
    assert _devices(host) == ["cpu"] * 4
    assert host["x"] is src["x"]  # already on the CPU: no copy
    torch.testing.assert_close(host["pair"].a, torch.arange(2))
