"""State round trips restore into objects built with DIFFERENT constructor arguments.

A resume test that rebuilds the object with the same arguments cannot see a ``load_state_dict`` that forgets a
field: the constructor already put the right value there. Here the restored object starts from other arguments,
so every field the continuation depends on must come from the state. (The trainer checkpoint's round trip:
tests/integration/test_trainer_resume.py.)
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_ppo.algo import kl_control as K
from megatron_ppo.config.schema import OptimConfig
from megatron_ppo.data.sampler import StatefulSampler
# The one place that names where the lr schedule is built (it moves with the role workers).
from megatron_ppo.workers.megatron_worker import _lr_scheduler as build_lr_scheduler

KLS = [0.01, 0.3, 0.02, 0.25, 0.0, 0.5, 0.12, 0.07, 0.4, 0.03, 0.2, 0.15]


def _json(state: dict) -> dict:
    return json.loads(json.dumps(state))  # checkpoints store it as JSON: must round-trip


def _continue(ctrl, kls, n_steps=64):
    values = []
    for kl in kls:
        values.append(ctrl.value)
        ctrl.update(kl, n_steps)
    return values


@pytest.mark.parametrize("make, make_other", [
    (lambda: K.FixedKLController(0.02), lambda: K.FixedKLController(0.9)),
    (lambda: K.AdaptiveKLController(0.05, 0.1, 500), lambda: K.AdaptiveKLController(0.5, 3.0, 1e6)),
    (lambda: K.AdaptiveKLController(0.05, 0.1, 500), lambda: K.AdaptiveKLController(0.05, 0.1, 1e6)),  # horizon
    (lambda: K.AdaptiveKLController(0.05, 0.1, 500), lambda: K.AdaptiveKLController(0.05, 3.0, 500)),  # target
    (lambda: K.PhasedKLController([(0.25, 0.1), (0.5, 0.01), (1.0, 0.05)], 12),
     lambda: K.PhasedKLController([(1.0, 0.7)], 1000)),
], ids=["fixed", "adaptive", "adaptive-horizon", "adaptive-target", "phased"])
def test_kl_controller_restored_into_other_arguments_continues_identically(make, make_other):
    straight = make()
    expected = _continue(straight, KLS)
    first = make()
    _continue(first, KLS[:5])
    resumed = make_other()
    resumed.load_state_dict(_json(first.state_dict()))
    assert _continue(resumed, KLS[5:]) == expected[5:]
    assert resumed.state_dict() == straight.state_dict()


@pytest.mark.parametrize("other_target", [None, 5.0, 0.01])
def test_target_kl_guard_restored_into_other_target(other_target):
    guard = K.TargetKLGuard(0.1)
    for kl in (0.05, 0.2, 0.3):
        guard.should_skip(kl)
    resumed = K.TargetKLGuard(other_target)
    resumed.load_state_dict(_json(guard.state_dict()))
    assert resumed.state_dict() == guard.state_dict()
    assert [resumed.should_skip(kl) for kl in (0.09, 0.11, 0.05)] == [False, True, False]
    assert resumed.step_metrics() == {"actor/kl_guard_skips": 3.0, "actor/kl_guard_skips_total": 3.0}


def test_sampler_restored_into_other_seed_and_position():
    reference = StatefulSampler(13, 3, seed=4)
    batches = [reference.next_batch() for _ in range(10)]
    first = StatefulSampler(13, 3, seed=4)
    for _ in range(6):
        first.next_batch()  # epoch 1, mid-epoch
    assert first.state_dict()["epoch"] == 1 and first.state_dict()["position"] > 0
    resumed = StatefulSampler(13, 3, seed=77)
    resumed.next_batch()  # its own epoch/position must be overwritten
    resumed.load_state_dict(_json(first.state_dict()))
    assert [resumed.next_batch() for _ in range(4)] == batches[6:]


def _scheduler(**optim):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    return optimizer, build_lr_scheduler(optimizer, OptimConfig(**optim), 20)


def _lrs(optimizer, scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return out


SAVED = dict(lr=1e-3, lr_warmup_steps=3, lr_decay_style="cosine", min_lr=1e-5)


def test_lr_scheduler_restored_into_same_arguments_continues_identically():
    expected = _lrs(*_scheduler(**SAVED), 12)
    opt, first = _scheduler(**SAVED)
    _lrs(opt, first, 5)
    opt2, resumed = _scheduler(**SAVED)
    resumed.load_state_dict(_json(first.state_dict()))
    assert _lrs(opt2, resumed, 7) == pytest.approx(expected[5:], rel=1e-12)


def test_lr_scheduler_restored_into_other_arguments_continues_identically():
    expected = _lrs(*_scheduler(**SAVED), 12)
    opt, first = _scheduler(**SAVED)
    _lrs(opt, first, 5)
    opt2, resumed = _scheduler(lr=5e-2, lr_warmup_steps=1, lr_decay_style="linear", min_lr=0.0)
    _lrs(opt2, resumed, 2)  # a scheduler that already stepped: the saved count must replace its own
    resumed.load_state_dict(_json(first.state_dict()))
    assert _lrs(opt2, resumed, 7) == pytest.approx(expected[5:], rel=1e-12)
