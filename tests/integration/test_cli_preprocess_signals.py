"""Signals (issue 15): `megatron-ppo preprocess gsm8k` stopped by SIGTERM (`kill PID`) or SIGINT (Ctrl-C) while it
reads or while it writes exits 143/130 with one line saying what was (not) written, and leaves no process, no temp
dir and no partial set a later run would take as complete. Real processes, real signals, real GSM8K text (repeated
so that each phase lasts seconds)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_ppo.data.gsm8k import default_gsm8k_dir
from megatron_ppo.data.manifest import MANIFEST_NAME, check_against_manifest
from megatron_ppo.data.preprocess import preprocess_arithmetic
from megatron_ppo.testing.processes import interrupt, still_alive

REPO = Path(__file__).resolve().parents[2]
REPEAT = 12  # x GSM8K (7473 + 1319 rows): ~100k rows, seconds to read and to write on this machine


@pytest.fixture(scope="module")
def large_gsm8k(tmp_path_factory):
    src = default_gsm8k_dir()
    if not (src / "train.jsonl").is_file():
        pytest.skip(f"GSM8K jsonl not found in {src} (set MEGATRON_PPO_GSM8K_DIR)")
    out = tmp_path_factory.mktemp("gsm8k_large")
    for split in ("train", "test"):
        text = (src / f"{split}.jsonl").read_text(encoding="utf-8")
        (out / f"{split}.jsonl").write_text(text * REPEAT, encoding="utf-8")
    return out


def _wait_for(proc, tmp_path, phase: str) -> None:
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, ("preprocess finished before the signal", proc.communicate())
        assert time.monotonic() < deadline, f"phase {phase!r} never reached"
        writing = list(tmp_path.glob(".out.writing-*"))
        if phase == "writing" and writing:
            time.sleep(0.05)  # inside the write
            return
        if phase == "reading":
            assert not writing, "already writing: make the input larger"
            try:
                reading = [f for f in psutil.Process(proc.pid).open_files() if f.path.endswith("train.jsonl")]
            except psutil.Error:
                reading = []
            if reading:  # inside the jsonl -> rows loop
                time.sleep(0.2)
                return
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["reading", "writing"])
@pytest.mark.parametrize("sig, code, name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_preprocess_interrupted_leaves_nothing(large_gsm8k, tmp_path, phase, sig, code, name):
    out = tmp_path / "out"
    old = None
    if phase == "writing":  # over an earlier set: it must stay whole, not become half old, half new
        preprocess_arithmetic(out, train_rows=8, test_rows=4)
        old = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ppo.cli", "preprocess", "gsm8k", "--input",
                             str(large_gsm8k), "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(proc, tmp_path, phase)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    tree, stdout, stderr = interrupt(proc, sig)
    assert proc.returncode == code, (proc.returncode, stderr)
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("INFO ")]
    assert len(lines) == 1 and f"interrupted by {name}" in lines[0] and "nothing was written" in lines[0], stderr
    assert "Traceback" not in stderr and "rows ->" not in stdout
    time.sleep(0.3)
    assert still_alive(tree) == [], "processes of the preprocess still alive"
    if old is None:
        assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no temp dir, no partial output
    else:
        assert [p.name for p in tmp_path.iterdir()] == ["out"], list(tmp_path.iterdir())  # temp dir removed
        assert {p.name: p.read_bytes() for p in out.iterdir()} == old  # the earlier set, byte for byte
        for name in ("train.parquet", "test.parquet"):
            check_against_manifest(out / name)
        assert (out / MANIFEST_NAME).is_file()
