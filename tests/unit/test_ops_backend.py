"""Backend selection of megatron_ppo.ops: MEGATRON_PPO_OPS forces the reference or requires the kernels, the choice
is reported by ops.backend() and logged once per op and device."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_ppo import ops
from megatron_ppo.ops import _backend


@pytest.fixture(autouse=True)
def no_override():
    previous = _backend.set_mode(None)
    yield
    _backend.set_mode(previous)


def test_env_var_forces_the_reference(monkeypatch):
    monkeypatch.setenv("MEGATRON_PPO_OPS", "reference")
    assert ops.mode() == "reference"
    assert ops.backend("cpu") == "reference"
    assert _backend.kernels_for(torch.device("cpu"), "gae") is None
    monkeypatch.setenv("MEGATRON_PPO_OPS", "auto")
    assert ops.backend("cpu") == "cpu"


def test_reference_and_kernels_give_the_same_answers(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 20, generator=gen), torch.randn(3, 20, generator=gen)
    mask = torch.rand(3, 20, generator=gen) < 0.8
    logits, target = torch.randn(5, 300, generator=gen), torch.randint(0, 300, (5,), generator=gen)
    results = {}
    for value in ("reference", "kernels"):
        monkeypatch.setenv("MEGATRON_PPO_OPS", value)
        results[value] = (*ops.gae(rewards, values, mask, 0.99, 0.95), *ops.token_logprobs_entropy(logits, target))
    for ref, ker in zip(results["reference"], results["kernels"]):
        torch.testing.assert_close(ker, ref, rtol=1e-5, atol=1e-5)


def test_set_mode_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("MEGATRON_PPO_OPS", "reference")
    _backend.set_mode("auto")
    assert ops.backend("cpu") == "cpu"
    _backend.set_mode(None)
    assert ops.backend("cpu") == "reference"
    with pytest.raises(ValueError, match="ops mode must be one of"):
        ops.set_mode("fast")


def test_bad_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MEGATRON_PPO_OPS", "turbo")
    with pytest.raises(ValueError, match="MEGATRON_PPO_OPS must be one of"):
        ops.gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.9, 0.9)


def test_kernels_mode_fails_loudly_where_there_are_none(monkeypatch):
    monkeypatch.setenv("MEGATRON_PPO_OPS", "kernels")
    with pytest.raises(RuntimeError, match="no meta kernels for ops.gae"):
        _backend.kernels_for(torch.device("meta"), "gae")
    if not torch.cuda.is_available():
        assert ops.backend("cuda") == "reference"
        assert "megatron_ppo._kernels_cuda" in (ops.unavailable_reason("cuda") or "")


def test_choice_is_logged_once(monkeypatch, caplog):
    monkeypatch.setenv("MEGATRON_PPO_OPS", "auto")
    _backend._logged.discard(("gae", "cpu"))
    with caplog.at_level(logging.INFO, logger="megatron_ppo.ops"):
        for _ in range(3):
            ops.gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.9, 0.9)
    lines = [r.getMessage() for r in caplog.records if "ops.gae" in r.getMessage()]
    assert lines == ["megatron_ppo.ops.gae: cpu kernels (megatron_ppo._kernels_cpu)"]


def test_a_kernel_extension_that_fails_to_load_is_a_warning_under_auto_and_an_error_under_kernels(monkeypatch, caplog):
    """A CUDA (or CPU) extension that does not import must not leave a run quietly on the torch reference."""
    monkeypatch.setattr(_backend, "_EXTENSIONS", {"cpu": "megatron_ppo._no_such_kernels"})
    monkeypatch.setattr(_backend, "_modules", {})
    monkeypatch.setattr(_backend, "_load_errors", {})
    monkeypatch.setattr(_backend, "_logged", set())
    monkeypatch.setenv("MEGATRON_PPO_OPS", "auto")
    with caplog.at_level(logging.INFO, logger="megatron_ppo.ops"):
        assert _backend.kernels_for(torch.device("cpu"), "gae") is None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "megatron_ppo._no_such_kernels not importable" in warned[0].getMessage()
    monkeypatch.setenv("MEGATRON_PPO_OPS", "kernels")
    with pytest.raises(RuntimeError, match="no cpu kernels for ops.gae: megatron_ppo._no_such_kernels"):
        _backend.kernels_for(torch.device("cpu"), "gae")
    monkeypatch.setenv("MEGATRON_PPO_OPS", "reference")  # asked for: not a warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_ppo.ops"):
        _backend.kernels_for(torch.device("cpu"), "logprob")
    assert [r.levelno for r in caplog.records] == [logging.INFO]
