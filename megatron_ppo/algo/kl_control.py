"""KL coefficient controllers (fixed, adaptive, phased), KL-in-reward, and the target-KL guard.

Every controller has ``.value`` (the coefficient to use now), ``.update(current_kl, n_steps)`` (called once per
training step after the KL is measured) and ``state_dict()`` / ``load_state_dict()`` for resume.
verl 0.9.1 counterparts: ``core_algos.FixedKLController`` / ``AdaptiveKLController`` / ``get_kl_controller``
and ``ray_trainer.apply_kl_penalty``; the phased controller and the guard are ours.
"""
from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import torch

from megatron_ppo.algo import checks
from megatron_ppo.algo.advantages import masked_mean_unchecked
from megatron_ppo.algo.losses import kl_estimate, parse_kl_type

KL_CONTROLLER_TYPES = ("fixed", "adaptive", "phased")
_CONTROLLER_KEYS = ("kl_coef", "target_kl", "horizon", "phases", "total_steps")


def _measured_kl(current_kl, name: str = "current_kl") -> float:
    return checks.real_number(current_kl, name)


def _load(state: dict, kind: str, keys: Sequence[str]) -> None:
    if not isinstance(state, dict) or state.get("type") != kind:
        got = state.get("type") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state_dict is for a {got!r} KL controller, expected {kind!r}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"state_dict misses keys {missing} for a {kind!r} KL controller")


class FixedKLController:
    """Constant coefficient."""

    def __init__(self, kl_coef: float):
        self.value = checks.real_number(kl_coef, "kl_coef", low=0.0)

    def update(self, current_kl, n_steps) -> None:
        _measured_kl(current_kl)

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _load(state, "fixed", ["value"])
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019 (arXiv:1909.08593): value *= 1 + clip(kl / target - 1, +-0.2) * n_steps / horizon.

    ``n_steps`` is what verl passes: the number of samples in the step (batch size); ``horizon`` is in the same
    unit (verl default 10000).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = checks.real_number(init_kl_coef, "init_kl_coef", low=0.0)
        self.target = checks.real_number(target_kl, "target_kl", low=0.0, low_inclusive=False)
        self.horizon = checks.real_number(horizon, "horizon", low=0.0, low_inclusive=False)

    def update(self, current_kl, n_steps) -> None:
        kl = _measured_kl(current_kl)
        n = checks.real_number(n_steps, "n_steps", low=0.0)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _load(state, "adaptive", ["value", "target", "horizon"])
        self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), float(state["horizon"])


class PhasedKLController:
    """Piecewise-constant schedule over the run: ``phases`` = [(end_fraction, coef), ...], fractions of
    ``total_steps`` strictly increasing, the last one 1.0. At step s (0-based count of update() calls so far)
    the coefficient is that of the first phase with s / total_steps < end_fraction; after total_steps the last
    phase's. E.g. [(0.2, 0.08), (0.8, 0.05), (1.0, 0.06)]: 0.08 for the first 20% of steps, 0.05 to 80%, then 0.06.

    One update() call = one training step; its ``n_steps`` (verl passes the batch size there) is not used, so
    the schedule cannot run ahead when a driver copies verl's call.
    """

    def __init__(self, phases, total_steps: int):
        self.phases = self._check_phases(phases)
        self.total_steps = checks.integer(total_steps, "total_steps", low=1)
        self.step = 0

    @staticmethod
    def _check_phases(phases) -> list[tuple[float, float]]:
        if not isinstance(phases, Sequence) or isinstance(phases, str) or len(phases) == 0:
            raise ValueError(f"phases must be a non-empty list of (end_fraction, coef) pairs, got {phases!r}")
        out: list[tuple[float, float]] = []
        for i, phase in enumerate(phases):
            if isinstance(phase, dict):
                phase = (phase.get("end_fraction"), phase.get("coef"))
            if not isinstance(phase, Sequence) or isinstance(phase, str) or len(phase) != 2:
                raise ValueError(f"phases[{i}] must be an (end_fraction, coef) pair, got {phase!r}")
            end = checks.real_number(phase[0], f"phases[{i}].end_fraction", low=0.0, high=1.0, low_inclusive=False)
            coef = checks.real_number(phase[1], f"phases[{i}].coef", low=0.0)
            if out and end <= out[-1][0]:
                raise ValueError(f"phases[{i}].end_fraction must be > phases[{i - 1}].end_fraction ({out[-1][0]}), "
                                 f"got {end}")
            out.append((end, coef))
        if out[-1][0] != 1.0:
            raise ValueError(f"phases[{len(out) - 1}].end_fraction must be 1.0 so the phases cover the whole run, "
                             f"got {out[-1][0]}")
        return out

    def value_at(self, step: int) -> float:
        # Exact rational comparison against the decimal the user wrote (0.2 -> 1/5): step 10 of 50 is in phase 2.
        fraction = Fraction(checks.integer(step, "step", low=0), self.total_steps)
        for end, coef in self.phases:
            if fraction < Fraction(repr(end)):
                return coef
        return self.phases[-1][1]

    @property
    def value(self) -> float:
        return self.value_at(self.step)

    def update(self, current_kl, n_steps) -> None:
        _measured_kl(current_kl)
        self.step += 1

    def state_dict(self) -> dict:
        return {"type": "phased", "phases": [list(p) for p in self.phases], "total_steps": self.total_steps,
                "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        _load(state, "phased", ["phases", "total_steps", "step"])
        self.phases = self._check_phases(state["phases"])
        self.total_steps = checks.integer(state["total_steps"], "total_steps", low=1)
        self.step = checks.integer(state["step"], "step", low=0)


def build_kl_controller(type: str, **kwargs):  # noqa: A002 (verl's config key is ``type``)
    """Factory from config: fixed(kl_coef) | adaptive(kl_coef, target_kl, horizon) | phased(phases, total_steps).

    Keys as verl's ``algorithm.kl_ctrl`` (plus phases, total_steps). Keys another type needs are ignored (so a
    config dataclass can pass all its fields); unknown or missing ones raise ValueError naming them.
    """
    checks.choice(type, "type", KL_CONTROLLER_TYPES)
    unknown = sorted(set(kwargs) - set(_CONTROLLER_KEYS))
    if unknown:
        raise ValueError(f"unknown KL controller keys {unknown} (known: {list(_CONTROLLER_KEYS)})")
    required = {"fixed": ("kl_coef",), "adaptive": ("kl_coef", "target_kl", "horizon"),
                "phased": ("phases", "total_steps")}[type]
    missing = [k for k in required if kwargs.get(k) is None]
    if missing:
        raise ValueError(f"KL controller {type!r} needs {missing}")
    if type == "fixed":
        return FixedKLController(kwargs["kl_coef"])
    if type == "adaptive":
        return AdaptiveKLController(kwargs["kl_coef"], kwargs["target_kl"], kwargs["horizon"])
    return PhasedKLController(kwargs["phases"], kwargs["total_steps"])


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (verl's ray_trainer.apply_kl_penalty): rewards = scores - beta * kl * mask with
    beta = kl_ctrl.value; then kl_ctrl.update(batch-mean of per-sequence mean KL, n_steps=batch size).
    Returns (token_level_rewards, metrics actor/reward_kl_penalty and actor/reward_kl_penalty_coeff).
    """
    checks.float_tensor(token_level_scores, "token_level_scores", ndim=2)
    mask = checks.mask(response_mask, "response_mask", "token_level_scores", token_level_scores)
    checks.finite(token_level_scores, "token_level_scores", mask)
    checks.float_like(old_log_prob, "old_log_prob", "token_level_scores", token_level_scores)
    checks.float_like(ref_log_prob, "ref_log_prob", "token_level_scores", token_level_scores)
    checks.finite(old_log_prob, "old_log_prob", mask)
    checks.finite(ref_log_prob, "ref_log_prob", mask)
    kind, _ = parse_kl_type(kl_penalty)  # "+" only changes gradients; rewards carry none
    with torch.no_grad():
        kld = kl_estimate(old_log_prob, ref_log_prob, kind)
        kld = torch.where(mask, kld, torch.zeros((), dtype=kld.dtype, device=kld.device))
        beta = kl_ctrl.value
        rewards = token_level_scores - beta * kld
        current_kl = masked_mean_unchecked(kld, mask, axis=-1).mean().item() if kld.shape[0] else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


class TargetKLGuard:
    """Skip the actor update when the measured KL exceeds ``target_kl`` (None disables the guard).

    Call ``should_skip(kl)`` before each actor mini-batch update (or once per step); it counts checks and skips.
    ``step_metrics()`` returns actor/kl_guard_skips (skips since the previous call, i.e. this step) and
    actor/kl_guard_skips_total, then starts a new step. A NaN/inf KL is an error, not a skip.
    """

    def __init__(self, target_kl: float | None):
        self.target_kl = None if target_kl is None else checks.real_number(
            target_kl, "target_kl", low=0.0, low_inclusive=False)
        self.total_skips = 0
        self.total_checks = 0
        self.step_skips = 0

    def should_skip(self, measured_kl) -> bool:
        kl = _measured_kl(measured_kl, "measured_kl")
        self.total_checks += 1
        skip = self.target_kl is not None and kl > self.target_kl
        if skip:
            self.total_skips += 1
            self.step_skips += 1
        return skip

    def step_metrics(self) -> dict[str, float]:
        metrics = {"actor/kl_guard_skips": float(self.step_skips), "actor/kl_guard_skips_total": float(self.total_skips)}
        self.step_skips = 0
        return metrics

    def state_dict(self) -> dict:
        return {"type": "target_kl_guard", "target_kl": self.target_kl, "total_skips": self.total_skips,
                "total_checks": self.total_checks, "step_skips": self.step_skips}

    def load_state_dict(self, state: dict) -> None:
        _load(state, "target_kl_guard", ["target_kl", "total_skips", "total_checks", "step_skips"])
        self.target_kl = None if state["target_kl"] is None else checks.real_number(
            state["target_kl"], "target_kl", low=0.0, low_inclusive=False)
        self.total_skips = checks.integer(state["total_skips"], "total_skips", low=0)
        self.total_checks = checks.integer(state["total_checks"], "total_checks", low=0)
        self.step_skips = checks.integer(state["step_skips"], "step_skips", low=0)


