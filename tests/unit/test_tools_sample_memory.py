"""tools/sample_memory.py: the machine's used memory sampled while a command runs (the memory numbers on the SmolLM2
learning page come from it)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sample_memory  # noqa: E402

# (no assertion that the peak sees a child's allocation: the machine's used memory is every process's, and a training
# run beside the tests moved it by more than a 400 MiB child did; standalone, that child moved the peak by 0.5 GiB)
HOLD = "import time; time.sleep(1.5)"


def test_a_command_is_sampled_and_its_exit_status_kept(tmp_path, capsys):
    out = tmp_path / "mem.csv"
    rc = sample_memory.main(["--out", str(out), "--interval", "0.1", "--", sys.executable, "-c",
                             HOLD + "; raise SystemExit(3)"])
    assert rc == 3
    rows = out.read_text().splitlines()
    assert rows[0] == "seconds,used_gib,available_gib" and len(rows) > 10  # ~1.5 s at 0.1 s
    seconds = [float(r.split(",")[0]) for r in rows[1:]]
    assert seconds == sorted(seconds)
    peak = sample_memory.peak_from_csv(out)
    assert peak == max(float(r.split(",")[1]) for r in rows[1:]) > 0
    assert f"machine peak: {peak:.2f} GiB" in capsys.readouterr().out


def test_the_printed_peak_is_the_csvs_peak(tmp_path, capsys, monkeypatch):
    """CI once printed 4.72 over a CSV whose peak row read 4.715: the sampler kept the unrounded value."""
    total = 24 * sample_memory.GIB
    used = int(4.7152 * sample_memory.GIB)  # 4.715 at the CSV's three decimals, 4.72 unrounded at two
    monkeypatch.setattr(sample_memory.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=total, available=total - used))
    out = tmp_path / "mem.csv"
    assert sample_memory.main(["--out", str(out), "--interval", "0.05", "--", sys.executable, "-c", "pass"]) == 0
    assert sample_memory.peak_from_csv(out) == 4.715
    assert "machine peak: 4.71 GiB used of 24.00" in capsys.readouterr().out


def test_missing_or_empty_csv_has_no_peak(tmp_path):
    assert sample_memory.peak_from_csv(tmp_path / "none.csv") is None
    (tmp_path / "empty.csv").write_text("seconds,used_gib,available_gib\n")
    assert sample_memory.peak_from_csv(tmp_path / "empty.csv") is None


def test_a_command_or_a_pid_not_both(tmp_path):
    with pytest.raises(SystemExit):
        sample_memory.main(["--out", str(tmp_path / "m.csv")])
    with pytest.raises(SystemExit):
        sample_memory.main(["--out", str(tmp_path / "m.csv"), "--pid", "1", "--", "true"])
