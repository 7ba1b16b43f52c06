"""KL controllers, KL-in-reward and the target-KL guard.

Fixed/adaptive controllers are compared with verl 0.9.1's classes at rel 1e-12 (same float64 arithmetic);
the phased schedule with a float64/Fraction hand reference; KL-in-reward with verl's kl_penalty + masked_mean
(ray_trainer.apply_kl_penalty itself cannot be imported here) at rtol 1e-7.
"""
import json
import os
from fractions import Fraction

os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402

from megatron_ppo.algo import kl_control as K  # noqa: E402

FAST = settings(max_examples=40, deadline=None)
SEED_PHASES = [(0.2, 0.08), (0.8, 0.05), (1.0, 0.06)]


# ------------------------------------------------------------------------------------------ fixed / adaptive


@FAST
@given(init=st.floats(0.0, 1.0), target=st.floats(1e-3, 1.0), horizon=st.floats(1.0, 1e5),
       kls=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30), n_steps=st.integers(1, 2048))
def test_adaptive_controller_matches_verl(init, target, horizon, kls, n_steps):
    ours = K.AdaptiveKLController(init, target, horizon)
    theirs = core_algos.AdaptiveKLController(init, target, horizon)
    for kl in kls:
        ours.update(kl, n_steps)
        theirs.update(kl, n_steps)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_factory_matches_verl(kind):
    cfg = dict(type=kind, kl_coef=0.05, horizon=10000, target_kl=0.1)
    ours = K.build_kl_controller(**cfg)
    theirs = core_algos.get_kl_controller(OmegaConf.create(cfg))
    assert type(ours).__name__ == type(theirs).__name__
    for kl in (0.3, 0.01, 0.12, 0.0):
        ours.update(kl, 256)
        theirs.update(kl, 256)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-12)


def test_factory_errors_name_the_key():
    with pytest.raises(ValueError, match="type"):
        K.build_kl_controller("linear", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon"):
        K.build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1)
    with pytest.raises(ValueError, match="total_steps"):
        K.build_kl_controller("phased", phases=SEED_PHASES)
    with pytest.raises(ValueError, match="klcoef"):
        K.build_kl_controller("fixed", klcoef=0.1)
    with pytest.raises(ValueError, match="horizon"):
        K.build_kl_controller("adaptive", kl_coef=0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        K.build_kl_controller("adaptive", kl_coef=0.1, target_kl=-1, horizon=10)
    # keys of other controller types are ignored, so a config dataclass can pass all its fields
    fixed = K.build_kl_controller("fixed", kl_coef=0.1, target_kl=0.1, horizon=10000, phases=None, total_steps=None)
    assert fixed.value == 0.1


def test_controllers_reject_nan_kl():
    for ctrl in (K.FixedKLController(0.1), K.AdaptiveKLController(0.1, 0.1, 100),
                 K.PhasedKLController(SEED_PHASES, 10)):
        with pytest.raises(ValueError, match="current_kl"):
            ctrl.update(float("nan"), 1)


# ------------------------------------------------------------------------------------------------------ phased


def phased_reference(phases, total_steps, step):
    """Exact reference: the first phase whose (decimal) end fraction is beyond step / total_steps."""
    fraction = Fraction(step, total_steps)
    for end, coef in phases:
        if fraction < Fraction(str(end)):
            return coef
    return phases[-1][1]


def test_phased_controller_seed_schedule_float64_reference():
    ctrl = K.build_kl_controller("phased", phases=SEED_PHASES, total_steps=50)
    seen = []
    for _ in range(60):  # runs past total_steps: stays at the last phase
        seen.append(ctrl.value)
        ctrl.update(0.01, 1024)  # n_steps (verl passes the batch size) does not move the schedule
    expected = [0.08] * 10 + [0.05] * 30 + [0.06] * 20  # 20% of 50 = 10 steps, 80% = 40
    assert seen == expected
    assert [phased_reference(SEED_PHASES, 50, s) for s in range(60)] == expected


@FAST
@given(ends=st.lists(st.integers(1, 99), min_size=0, max_size=5, unique=True),
       coefs=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6), total=st.integers(1, 300))
def test_phased_controller_matches_reference(ends, coefs, total):
    phases = [(e / 100, c) for e, c in zip(sorted(ends), coefs, strict=False)] + [(1.0, coefs[-1])]
    ctrl = K.PhasedKLController(phases, total)
    for step in range(total + 3):
        assert ctrl.value == phased_reference(phases, total, step)
        ctrl.update(0.0, 1)


@pytest.mark.parametrize("phases,match", [
    ([], "phases"), ([(0.5, 0.1)], r"phases\[0\].end_fraction must be 1.0"),
    ([(0.5, 0.1), (0.5, 0.2), (1.0, 0.1)], r"phases\[1\].end_fraction must be >"),
    ([(0.5, -0.1), (1.0, 0.1)], r"phases\[0\].coef"), ([(1.2, 0.1)], r"phases\[0\].end_fraction"),
    ([(0.5,), (1.0, 0.1)], r"phases\[0\]"), ("0.2:0.1", "phases"),
])
def test_phased_controller_validates_phases(phases, match):
    with pytest.raises(ValueError, match=match):
        K.PhasedKLController(phases, 10)


def test_phased_accepts_dict_phases_from_yaml():
    ctrl = K.PhasedKLController([{"end_fraction": 0.5, "coef": 0.2}, {"end_fraction": 1.0, "coef": 0.1}], 4)
    assert [ctrl.value_at(s) for s in range(5)] == [0.2, 0.2, 0.1, 0.1, 0.1]


# ------------------------------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("make", [
    lambda: K.FixedKLController(0.02),
    lambda: K.AdaptiveKLController(0.05, 0.1, 500),
    lambda: K.PhasedKLController(SEED_PHASES, 20),
])
def test_state_dict_resume_continues_identically(make):
    gen = torch.Generator().manual_seed(0)
    kls = (torch.rand(25, generator=gen) * 0.3).tolist()
    straight = make()
    values = []
    for kl in kls:
        values.append(straight.value)
        straight.update(kl, 64)

    first = make()
    for kl in kls[:9]:
        first.update(kl, 64)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON: must round-trip
    resumed = make()
    resumed.load_state_dict(state)
    resumed_values = []
    for kl in kls[9:]:
        resumed_values.append(resumed.value)
        resumed.update(kl, 64)
    assert resumed_values == values[9:]


def test_load_state_dict_rejects_other_kinds():
    with pytest.raises(ValueError, match="state_dict"):
        K.FixedKLController(0.1).load_state_dict(K.AdaptiveKLController(0.1, 0.1, 10).state_dict())
    with pytest.raises(ValueError, match="step"):
        K.PhasedKLController(SEED_PHASES, 10).load_state_dict({"type": "phased", "phases": SEED_PHASES,
                                                               "total_steps": 10})


# ----------------------------------------------------------------------------------------------- KL in reward


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "abs", "mse"])
def test_apply_kl_penalty_matches_verl_recipe(kind):
    gen = torch.Generator().manual_seed(7)
    scores = torch.zeros(6, 9, dtype=torch.float64)
    scores[:, -1] = torch.randn(6, generator=gen, dtype=torch.float64)
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    ref = old + 0.3 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = (torch.arange(9)[None] < torch.randint(1, 10, (6,), generator=gen)[:, None]).double()

    ours_ctrl, verl_ctrl = K.AdaptiveKLController(0.1, 0.05, 1000), core_algos.AdaptiveKLController(0.1, 0.05, 1000)
    rewards, metrics = K.apply_kl_penalty(scores, old, ref, mask, ours_ctrl, kind)

    # verl 0.9.1 ray_trainer.apply_kl_penalty, lines 100-112, on the same inputs
    kld = core_algos.kl_penalty(old, ref, kl_penalty=kind) * mask
    expected_rewards = scores - verl_ctrl.value * kld
    current_kl = torch.mean(verl_F.masked_mean(kld, mask=mask, axis=-1), dim=0).item()
    verl_ctrl.update(current_kl=current_kl, n_steps=6)

    torch.testing.assert_close(rewards, expected_rewards, rtol=1e-7, atol=1e-9)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-7)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    assert ours_ctrl.value == pytest.approx(float(verl_ctrl.value), rel=1e-7)


# ----------------------------------------------------------------------------------------------- target-KL guard


def test_target_kl_guard_counts_skips_and_resumes():
    guard = K.TargetKLGuard(0.1)
    decisions = [guard.should_skip(kl) for kl in (0.05, 0.1, 0.11, torch.tensor(0.5), 0.0)]
    assert decisions == [False, False, True, True, False]  # "exceeds" is strict
    assert guard.step_metrics() == {"actor/kl_guard_skips": 2.0, "actor/kl_guard_skips_total": 2.0}
    assert guard.should_skip(0.2)
    state = json.loads(json.dumps(guard.state_dict()))
    resumed = K.TargetKLGuard(0.1)
    resumed.load_state_dict(state)
    assert resumed.step_metrics() == {"actor/kl_guard_skips": 1.0, "actor/kl_guard_skips_total": 3.0}
    assert resumed.total_checks == 6
    assert resumed.step_metrics()["actor/kl_guard_skips"] == 0.0


def test_target_kl_guard_disabled_and_bad_input():
    off = K.TargetKLGuard(None)
    assert not off.should_skip(1e9)
    assert off.step_metrics()["actor/kl_guard_skips"] == 0.0
    with pytest.raises(ValueError, match="measured_kl"):
        K.TargetKLGuard(0.1).should_skip(float("nan"))
    with pytest.raises(ValueError, match="target_kl"):
        K.TargetKLGuard(0.0)
