"""tools/scaling_sweep.py --slurm against the session's one-node cluster: one sweep point as a real job of
slurm/ppo_tiny.sh, read back into the CSV and the plot; nothing of the job is left running."""
from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import processes_naming, ray_processes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_scaling_sweep_slurm_point(slurm_cluster, tmp_path):
    out, table, png = tmp_path / "sweep", tmp_path / "scaling.csv", tmp_path / "scaling.png"
    r = subprocess.run([sys.executable, "tools/scaling_sweep.py", "--slurm", "--models", "h64", "--ranks", "2",
                        "--modes", "strong", "--batch", "4", "--steps", "1", "--out", str(out), "--csv", str(table),
                        "--png", str(png)], cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True,
                       timeout=900)
    point = out / "strong_h64_r2_b4"
    job_out = (point / "job.out").read_text(errors="replace") if (point / "job.out").exists() else ""
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}\n{job_out[-3000:]}"
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row["mode"], row["model"], row["ranks"], row["batch"], row["steps"]) == ("strong", "h64", "2", "4", "1")
    for key in ("tokens_per_s", "step_s", "gen_s", "update_actor_s", "update_critic_s"):
        assert float(row[key]) > 0, (key, row)
    assert math.isnan(float(row["peak_rank_rss_mib"])), row  # not measurable from outside the job: NaN, not 0
    assert png.stat().st_size > 0
    # The job ran the point's overrides (2 ranks, DP 2) in the point's own run dir, and left nothing behind.
    assert "actor: TP=1 x PP=1 x DP=2 = 2 ranks" in job_out and "driver exited with 0" in job_out, job_out[-3000:]
    job_id = re.search(r"\[ray-on-slurm (\d+)\]", job_out).group(1)
    assert f"run dir {point}" in job_out
    assert not ray_processes(job_id) and not processes_naming(str(point))
    print(f"scaling_sweep --slurm: job {job_id}, {float(row['tokens_per_s']):.0f} tokens/s, "
          f"step {float(row['step_s']):.2f} s, wall {float(row['wall_s']):.0f} s")
