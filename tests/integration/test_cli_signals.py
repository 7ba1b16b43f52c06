"""Signals (issue 15): `megatron-ppo convert` stopped by SIGTERM (`kill PID`) or SIGINT (Ctrl-C) while it writes
leaves no process of its tree alive and no temp dir, prints one line and exits 143/130. Real processes, real signals."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


from megatron_ppo.testing.processes import interrupt, still_alive
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def medium_hf(tmp_path_factory):
    """A Llama big enough (~100 MB) that conversion takes seconds once the temp dir exists."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_ppo.testing.tiny_hf import make_tiny_hf

    tiny = make_tiny_hf("llama", str(tmp_path_factory.mktemp("tiny")))
    out = tmp_path_factory.mktemp("medium")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in os.listdir(tiny):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny, name), out / name)
    return str(out)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_convert_interrupted_leaves_nothing(medium_hf, tmp_path, sig, code, name):
    out = tmp_path / "mcore"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ppo.cli", "convert", "hf-to-mcore", "--hf", medium_hf,
                             "--out", str(out), "--quiet"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob(".mcore.tmp-*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no temp dir appeared"
            time.sleep(0.02)
        time.sleep(0.3)  # inside the write
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    tree, stdout, stderr = interrupt(proc, sig)
    assert proc.returncode == code, (proc.returncode, stderr)
    lines = [line for line in stderr.splitlines() if line.strip() and "INFO" not in line]
    assert len(lines) == 1 and f"interrupted by {name}" in lines[0] and "nothing was written" in lines[0], stderr
    assert "Traceback" not in stderr
    time.sleep(0.5)
    assert still_alive(tree) == [], "processes of the conversion still alive"
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no temp dir, no partial output
