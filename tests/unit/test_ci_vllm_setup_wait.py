""".ci/run builds the vLLM venv in the background: the vLLM tests wait for the build's exit code and fail, naming
its log, when it failed."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import vllm_env  # noqa: E402


def _write_later(path: Path, text: str, delay: float) -> None:
    def go():
        time.sleep(delay)
        path.write_text(text)
    threading.Thread(target=go, daemon=True).start()


def test_waits_for_the_exit_code_and_passes_on_0(tmp_path, monkeypatch):
    done = tmp_path / "rc"
    monkeypatch.setenv("MPPO_VLLM_SETUP_DONE", str(done))
    _write_later(done, "0\n", 2.5)
    start = time.monotonic()
    vllm_env.wait_for_background_setup()
    assert time.monotonic() - start >= 2.0


def test_a_failed_build_fails_naming_its_log(tmp_path, monkeypatch):
    done = tmp_path / "rc"
    done.write_text("2\n")
    monkeypatch.setenv("MPPO_VLLM_SETUP_DONE", str(done))
    monkeypatch.setenv("MPPO_VLLM_SETUP_LOG", "/tmp/setup-vllm.log")
    with pytest.raises(pytest.fail.Exception, match=r"exit 2 \(log: /tmp/setup-vllm.log\)"):
        vllm_env.wait_for_background_setup()


def test_without_the_variable_nothing_waits(monkeypatch):
    monkeypatch.delenv("MPPO_VLLM_SETUP_DONE", raising=False)
    vllm_env.wait_for_background_setup()
