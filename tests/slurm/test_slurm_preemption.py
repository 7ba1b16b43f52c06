"""Preemption on real Slurm: USR1 to the batch shell -> the driver saves and exits 0 -> the job requeues itself
(`scontrol requeue`) -> the run of the same job id resumes from that checkpoint and finishes; nothing is left.

The signal is sent with `scancel --signal=USR1 --batch` once step 1 is logged, instead of waiting for the
`#SBATCH --signal=B:USR1@60` warning before the time limit: the same signal to the same process (the batch shell
only, never the Ray ranks), minutes sooner."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from cluster import phase_recorder, processes_naming, ray_processes

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = 8
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+)\b")


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def _wait_for_step(cluster, job_id: str, metrics: Path, out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any("actor/pg_loss" in rec for rec in _records(metrics)):
        text = out.read_text(errors="replace") if out.exists() else ""
        assert time.monotonic() < deadline, f"no step logged in {timeout:.0f} s:\n{text[-3000:]}"
        assert cluster.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), text[-3000:]
        time.sleep(0.5)


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path, record_property):
    root, out = tmp_path / "runs", tmp_path / "job.out"
    start = time.monotonic()
    phase = phase_recorder(record_property)

    r = slurm_cluster.run("sbatch", "--parsable", f"--output={out}", f"--export=ALL,MPPO_RUN_ROOT={root}",
                          "slurm/ppo_tiny.sh", f"trainer.total_training_steps={STEPS}",
                          "trainer.val_before_train=false", cwd=REPO)
    job_id = r.stdout.strip().split(";")[0]
    run_dir = root / f"mppo-tiny-{job_id}"  # keyed by the job id: the requeued run finds it again
    metrics = run_dir / "logs" / "metrics.jsonl"
    _wait_for_step(slurm_cluster, job_id, metrics, out, timeout=400)
    phase("to_first_step")
    signalled = time.monotonic()
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)

    requeued = slurm_cluster.release_requeued(job_id, out, timeout=240)
    phase("usr1_to_requeued")
    seen: list = []
    state = slurm_cluster.wait_done(job_id, timeout=400, seen=seen)
    phase("resumed_run")
    text = out.read_text(errors="replace")
    assert state in ("COMPLETED", "GONE"), f"{state} {seen}\n{text[-4000:]}"
    assert any(s == "COMPLETED" for s, _ in seen), f"never seen COMPLETED: {seen}\n{text[-3000:]}"
    assert requeued["Restarts"] == "1" and all(restarts == "1" for _, restarts in seen), (requeued, seen)

    # First run: the driver saved at step k and exited 0; the job requeued itself.
    first, marker, second = text.partition(f"run 1 of job {job_id}")
    assert marker, f"the job never ran a second time:\n{text[-4000:]}"
    stopped = re.search(r"stopped by SIGUSR1 after step (\d+)", first)
    assert stopped, first[-4000:]
    k = int(stopped.group(1))
    assert 1 <= k < STEPS, f"saved at step {k} of {STEPS}: the signal came too late to test a resume"
    assert "driver exited with 0 after SIGUSR1" in first and f"requeueing job {job_id}" in first, first[-3000:]
    ckpt = run_dir / "checkpoints" / f"global_step_{k}"
    assert ckpt.is_dir(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    # Second run: resumed at step k + 1, ran to the end, exited 0, no second requeue.
    resumed_steps = [int(m.group(1)) for m in STEP_LINE.finditer(second)]
    assert resumed_steps and resumed_steps[0] == k + 1, (k, resumed_steps, second[-3000:])
    assert resumed_steps[-1] == STEPS and "driver exited with 0" in second, second[-3000:]
    assert "requeueing" not in second
    run = json.loads((run_dir / "logs" / "run.json").read_text())
    assert run["resumed_from_step"] == k, run
    steps = [rec["step"] for rec in _records(metrics) if "actor/pg_loss" in rec]
    assert steps == list(range(1, STEPS + 1)), steps  # each step once: the resumed run appended after step k

    # Nothing of the job is left: no Ray process of either run, no driver (its arguments name the run dir).
    time.sleep(1)
    assert not ray_processes(job_id), [p.cmdline()[:2] for p in ray_processes(job_id)]
    assert not processes_naming(str(run_dir)), [p.cmdline()[:3] for p in processes_naming(str(run_dir))]
    print(f"job {job_id}: saved at step {k}, requeued, resumed at step {k + 1}; USR1 -> COMPLETED "
          f"{time.monotonic() - signalled:.0f} s, whole test {time.monotonic() - start:.0f} s; requeued as "
          f"{requeued}, then {seen}")
