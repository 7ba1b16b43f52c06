"""The training console (issue 15): a rich progress bar with step i/N, ETA, reward, KL and step time on a terminal;
one plain summary line per step, and no terminal control codes, where stdout is a file or a pipe."""
from __future__ import annotations

import io
import os
import re

import pytest

from megatron_ppo import console
from megatron_ppo.trainer.progress import StepProgress, is_terminal
from megatron_ppo.trainer.tracking import Tracker

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _metrics(step: int) -> dict:
    return {"reward/score/mean": 0.25 * step, "actor/ppo_kl": 0.0012, "timing/step": 2.0,
            "critic/vf_loss": 0.5, **{f"actor/m{i}": float(i) for i in range(30)}}


@pytest.fixture(autouse=True)
def _fresh_clock(monkeypatch):
    console._step_clock.clear()
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)


def test_bar_renders_step_eta_reward_kl_and_step_time():
    out = io.StringIO()
    bar = StepProgress(4, stream=out, terminal=True)
    bar.show(1, _metrics(1))
    bar.show(2, _metrics(2))
    bar._progress.refresh()
    text = ANSI.sub("", out.getvalue())
    frame = [line for line in text.splitlines() if "━" in line][-1]  # the bar's last drawn row
    assert frame.startswith("step 2/4"), frame
    for part in ("reward 0.5", "kl 0.0012", "2.00 s/step", "ETA 0:00:0"):
        assert part in frame, (part, frame)
    assert "vf_loss" not in frame and "actor/m3" not in frame
    # the per-step summary lines scroll above the bar, one per step
    assert [line.split("  ")[0] for line in text.splitlines() if line.startswith("step ") and "━" not in line] \
        == ["step 1/4", "step 2/4"], text
    bar.close()
    assert bar._progress is None


def _drain(master: int) -> str:
    """Everything written to the pty: one read may return only part of it (seen once: only step 1 came back)."""
    import select

    chunks = []
    while select.select([master], [], [], 1.0)[0]:
        try:
            chunk = os.read(master, 1 << 20)
        except OSError:  # EIO: the slave side is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_bar_on_a_real_pseudo_terminal():
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=True) as tty:
            assert is_terminal(tty)
            bar = StepProgress(3, stream=tty)
            assert bar.terminal
            for step in (1, 2, 3):
                bar.show(step, _metrics(step))
            bar.close()
            tty.flush()
        raw = _drain(master)
    finally:
        os.close(master)
    assert "\x1b[" in raw and "━" in raw  # drawn and redrawn in place
    assert "step 3/3" in ANSI.sub("", raw)


def test_non_terminal_output_has_one_plain_line_per_step(tmp_path, capsys):
    tracker = Tracker(["console"], str(tmp_path))
    tracker.total_steps = 3
    tracker.log({"reward/score/mean": 0.1, "val-core/x/reward/mean@1": 0.0}, step=0)  # validation before training
    for step in (1, 2, 3):
        tracker.log(_metrics(step), step=step)
    tracker.close()
    out = capsys.readouterr().out
    assert not is_terminal(__import__("sys").stdout)
    assert "\x1b" not in out and "━" not in out, out  # no bar, no control codes in a log file
    lines = out.splitlines()
    assert lines[0].startswith("validation before training")
    assert [line.split("  ")[0] for line in lines[1:]] == ["step 1/3", "step 2/3", "step 3/3"], out
    assert all("reward" in line and "kl 0.0012" in line and "s/step" in line for line in lines[1:]), out


def test_verbose_prints_every_metric_without_a_bar(monkeypatch):
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    out = io.StringIO()
    tracker_line = StepProgress(2, stream=out, terminal=False).show(1, _metrics(1), verbose=True)
    assert "actor/m29=29" in tracker_line and out.getvalue() == tracker_line + "\n"


def test_batch_progress_names_size_each_batch_and_duration(caplog):
    """Before step 1 (issue 49): a long validation says what it does, a line a batch, and how long it took."""
    import logging

    from megatron_ppo.trainer import progress

    clock = iter([0.0, 95.0, 190.0, 285.0, 448.0])
    with caplog.at_level(logging.INFO, logger="megatron_ppo.trainer.progress"):
        bar = progress.BatchProgress("validation before training", 256, 64, detail="greedy, n=1, up to 256 tokens",
                                     clock=lambda: next(clock))
        for _ in range(4):
            bar.advance(64)
    assert [r.getMessage() for r in caplog.records] == [
        "validation before training: 256 prompts in 4 batches of 64 (greedy, n=1, up to 256 tokens) ...",
        "validation before training: 64/256 prompts, 1:35",
        "validation before training: 128/256 prompts, 3:10",
        "validation before training: 192/256 prompts, 4:45",
        "validation before training: 256 prompts in 7:28"]
    assert [progress.duration(s) for s in (4.24, 59.9, 61, 3725)] == ["4.2 s", "59.9 s", "1:01", "1:02:05"]
