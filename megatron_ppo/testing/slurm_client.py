"""Slurm's client commands against a test cluster's config (``SLURM_CONF``): run one, read a job's fields, wait
for it to end. Shared by tests/slurm/cluster.py (one node) and testing/netns_cluster.py (several)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED", "GONE")


# slurm.conf lines both test clusters share: no munge, root daemons, linuxproc, no accounting, quick scheduling and
# short timeouts (a dead node is declared DOWN 30 s after its death; Slurm's default is 300 s)
TEST_CLUSTER_SETTINGS = (
    "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root",
    "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
    "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
    "MpiDefault=none", "ReturnToService=2", "JobRequeue=1",
    "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
    "MinJobAge=2", "KillWait=5", "InactiveLimit=0", "SlurmctldTimeout=30", "SlurmdTimeout=30",
    "SchedulerParameters=sched_interval=1", "MessageTimeout=10",
)


class SlurmClient:
    conf: Path

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd, check: bool = True, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def job_fields(self, job_id: str) -> dict:
        """`scontrol show job` as key -> value (first token of each Key=value), {} once the job is gone."""
        r = self.run("scontrol", "show", "job", job_id, check=False)
        return dict(tok.split("=", 1) for tok in r.stdout.split() if "=" in tok) if r.returncode == 0 else {}

    def job_state(self, job_id: str) -> str:
        """JobState from scontrol, or GONE once the record has aged out (MinJobAge)."""
        return self.job_fields(job_id).get("JobState", "GONE")

    def wait_done(self, job_id: str, timeout: float, seen: list | None = None) -> str:
        """Poll until the job is in a final state (or gone); a requeued job passes through REQUEUED and PENDING
        again, which are not final. ``seen`` collects each state change, for the caller's assertions."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            state = fields.get("JobState", "GONE")
            if seen is not None and (not seen or seen[-1][0] != state):
                seen.append((state, fields.get("Restarts")))
            if state in FINAL_STATES:
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {state} after {timeout} s")

    def release_requeued(self, job_id: str, out: Path, timeout: float, *update: str) -> dict:
        """Wait until the job is PENDING again after its requeue, then make it eligible now: Slurm holds a requeued
        job back (BeginTime, 120 s measured with Slurm 22.05), which only slows the test. ``update``: more
        ``Key=value`` fields for the pending job (NumNodes=2). Returns the pending job's JobState, Reason, Restarts
        and StartTime as Slurm set them."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job_id)
            if fields.get("JobState") == "PENDING" and fields.get("Restarts") == "1":
                break
            text = out.read_text(errors="replace") if out.exists() else ""
            state = fields.get("JobState")
            assert state not in FINAL_STATES, f"{state}, not requeued:\n{text[-4000:]}"
            assert time.monotonic() < deadline, f"not requeued within {timeout:.0f} s:\n{text[-4000:]}"
            time.sleep(0.5)
        # Not "now": a job reallocated within the second of its requeue is killed by slurmd ("Job credential
        # revoked": the revocation is kept at one-second resolution; seen in CI), which Slurm's long hold avoids.
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3", *update)
        return {k: fields.get(k) for k in ("JobState", "Reason", "Restarts", "StartTime")}
