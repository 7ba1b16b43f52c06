"""Real Slurm jobs on the session's one-node cluster: fail-fast when a node's Ray process dies, teardown leaves
nothing, and shellcheck on slurm/*.sh. slurm/ppo_tiny.sh end to end: test_slurm_preemption.py (one node, 8 steps
over a requeue, exit 0) and test_slurm_multinode.py (three nodes)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from cluster import ray_processes as _ray_processes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _exit_code(out_text: str) -> int | None:
    for line in out_text.splitlines()[::-1]:
        if "teardown done (exit " in line:
            return int(line.rsplit("(exit ", 1)[1].rstrip(")"))
    return None


def test_shellcheck_clean(shellcheck):
    scripts = sorted(str(p) for p in (REPO / "slurm").glob("*.sh")) + \
        sorted(str(p) for p in (REPO / "tests/slurm/jobs").glob("*.sh"))
    assert len(scripts) >= 3
    r = subprocess.run([shellcheck, "-x", *scripts], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dead_ray_process_fails_the_job_naming_the_node(slurm_cluster, tmp_path):
    """Kill the node's raylet while the driver runs: the job exits non-zero within a minute, naming the node. With
    MPPO_REQUEUE_ON_NODE_LOSS=0 it just fails (by default a lost node requeues the job: test_slurm_multinode.py)."""
    marker, out = tmp_path / "ready", tmp_path / "job.out"
    env_args = [f"--export=ALL,MARKER={marker},HOLD_S=600,MPPO_REQUEUE_ON_NODE_LOSS=0"]
    r = slurm_cluster.run("sbatch", "--parsable", f"--output={out}", *env_args, "tests/slurm/jobs/ray_tasks.sh",
                          cwd=REPO)
    job_id = r.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert time.monotonic() < deadline, f"job never got ready:\n{out.read_text(errors='replace')[-3000:]}"
        assert slurm_cluster.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), \
            out.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    raylets = [p for p in _ray_processes(job_id) if "raylet" in " ".join(p.cmdline()[:1])]
    assert raylets, [p.cmdline()[:2] for p in _ray_processes(job_id)]
    killed_at = time.monotonic()
    for p in raylets:
        p.kill()
    state = slurm_cluster.wait_done(job_id, timeout=90)
    elapsed = time.monotonic() - killed_at
    text = out.read_text(errors="replace")
    assert f"node {slurm_cluster.node}: its Ray process" in text, text[-3000:]
    assert _exit_code(text) not in (0, None), text[-2000:]
    assert state == "FAILED", state
    assert elapsed < 60, f"the job took {elapsed:.0f} s to fail"
    assert "driver done" not in text
    assert "requeue" not in text, text[-2000:]
    time.sleep(1)
    assert not _ray_processes(job_id), [p.cmdline()[:2] for p in _ray_processes(job_id)]
    print(f"raylet killed -> job {job_id} FAILED in {elapsed:.1f} s")


def test_ray_tasks_on_every_node_and_clean_exit(slurm_cluster, tmp_path):
    """The bring-up with a driver that runs a Ray task on every node: exit 0, nothing left running."""
    marker, out = tmp_path / "ready", tmp_path / "job.out"
    r = slurm_cluster.run("sbatch", "--wait", "--parsable", f"--output={out}", f"--export=ALL,MARKER={marker}",
                          "tests/slurm/jobs/ray_tasks.sh", check=False, timeout=300, cwd=REPO)
    text = out.read_text(errors="replace")
    assert r.returncode == 0, text[-3000:]
    assert f"ray tasks ran on ['{slurm_cluster.node}']" in text and marker.exists()
    assert not _ray_processes(r.stdout.strip().split(";")[0])
