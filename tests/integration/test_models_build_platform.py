"""Building a model never sets up the platform (issue 10 item 5): parallel.initialize does, and build_gpt_model
without an active CPU platform layer in its thread fails with an error that says what to call."""
from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU platform layer is inactive with CUDA")


def test_build_gpt_model_does_not_switch_the_platform_on(megatron_single):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.parallel import platform

    assert platform.cpu_platform_enabled()  # parallel.initialize (the fixture) set it up
    build_gpt_model(tiny_arch(), "actor")
    platform.disable_cpu_platform()
    with pytest.raises(RuntimeError, match=r"CPU platform layer is not active in this thread.*parallel.initialize"):
        build_gpt_model(tiny_arch(), "actor")
    assert not platform.cpu_platform_enabled()  # the failed build left it off


def test_build_in_another_thread_names_the_fix(megatron_single):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.parallel import platform

    seen = {}

    def build():
        try:
            build_gpt_model(tiny_arch(), "actor")
        except RuntimeError as e:
            seen["error"] = str(e)
        seen["enabled_after"] = platform.cpu_platform_enabled()

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    assert "not active in this thread" in seen.get("error", ""), seen
    assert seen["enabled_after"] is False
