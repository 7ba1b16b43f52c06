"""The vLLM virtualenv for the tests that run a real vLLM (make setup-vllm). Missing: skipped on a developer's
machine, a failure in CI (CI=true: .ci/run builds it)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def vllm_python() -> Path:
    from megatron_ppo.config.schema import VllmRolloutConfig
    from megatron_ppo.errors import UsageError
    from megatron_ppo.rollout.vllm import check_vllm_python, vllm_python as resolve

    cfg = VllmRolloutConfig()
    try:
        check_vllm_python(cfg)
    except UsageError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the vLLM venv: {e}")
        pytest.skip(str(e))
    return resolve(cfg)
