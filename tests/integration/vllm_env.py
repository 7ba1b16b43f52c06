"""The vLLM virtualenv for the tests that run a real vLLM (make setup-vllm). Missing: skipped on a developer's
machine, a failure in CI (CI=true: .ci/run builds it, in the background while the first tests run: with
MPPO_VLLM_SETUP_DONE set, the first test waits for that file, the build's exit code)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


SETUP_WAIT_S = 1200


def wait_for_background_setup() -> None:
    """.ci/run's background `make setup-vllm`: wait until it wrote its exit code; fail, naming its log, if non-zero."""
    done = os.environ.get("MPPO_VLLM_SETUP_DONE")
    if not done:
        return
    deadline = time.monotonic() + SETUP_WAIT_S
    while not os.path.isfile(done) and time.monotonic() < deadline:
        time.sleep(2)
    rc = open(done).read().strip() if os.path.isfile(done) else f"not finished after {SETUP_WAIT_S} s"
    if rc != "0":
        pytest.fail(f"the background make setup-vllm: exit {rc} (log: {os.environ.get('MPPO_VLLM_SETUP_LOG')})")


def vllm_python() -> Path:
    from megatron_ppo.config.schema import VllmRolloutConfig
    from megatron_ppo.errors import UsageError
    from megatron_ppo.rollout.vllm import check_vllm_python, vllm_python as resolve

    wait_for_background_setup()
    cfg = VllmRolloutConfig()
    try:
        check_vllm_python(cfg)
    except UsageError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs the vLLM venv: {e}")
        pytest.skip(str(e))
    return resolve(cfg)
