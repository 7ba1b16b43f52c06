"""A one-node Slurm cluster in a temp dir for the Slurm tests: slurmctld + slurmd in the foreground of processes
this module starts (apt starts no services), no munge (auth/none, cred/none), config/state/spool/logs/pids under
the temp dir, ``SLURM_CONF`` pointing there. ``start()`` returns when the node is idle; ``stop()`` leaves nothing.

Lessons from bring-up: a second cluster on busy ports starts with exit 0 and then dies, so the ports are checked
first; a killed slurmd can linger as a zombie that looks alive, so liveness is the Popen's, and stop() reaps.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from megatron_ppo.testing.slurm_client import (FINAL_STATES, TEST_CLUSTER_SETTINGS,  # noqa: F401 (FINAL_STATES:
                                              SlurmClient)  # the tests import it from here)

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "srun", "sacct")


def ray_processes(job_id: str) -> list:
    """Processes of a job's Ray cluster: their command line names its per-job temp dir (/tmp/ray-<job>-<restart>)."""
    return processes_naming(f"/tmp/ray-{job_id}-")


def phase_recorder(record_property):
    """``phase(name)`` records the seconds since the previous call (or since this one) as a test property: CI's
    SLOW-NOW line (tests/conftest.py) prints them, so a slow run says where its time went."""
    clock = [time.monotonic()]

    def phase(name: str) -> None:
        now = time.monotonic()
        record_property(name, f"{now - clock[0]:.0f} s")
        clock[0] = now

    return phase


def processes_naming(text: str) -> list:
    """Live processes with ``text`` in one of their command-line arguments."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            pass
    return out


def installed() -> bool:
    return all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS) and \
        all(shutil.which(c) for c in CLIENTS[:4])


def _free_port_pair() -> tuple[int, int]:
    """Two consecutive ports nobody listens on (slurmctld, slurmd)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000 and all(_port_free(p) for p in (port, port + 1)):
            return port, port + 1
    raise RuntimeError("slurm test cluster: no two free consecutive ports found")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _node_line() -> str:
    """NodeName=... CPUs=... RealMemory=... as slurmd -C measures this machine."""
    out = subprocess.run([_daemon("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    line = out.splitlines()[0]
    return f"{line} State=UNKNOWN"


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster(SlurmClient):
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.node = None

    def write_conf(self) -> None:
        ctld_port, d_port = _free_port_pair()
        node = _node_line()
        self.node = node.split()[0].split("=", 1)[1]
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=mppo-test",
            f"SlurmctldHost={socket.gethostname()}",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={d_port}",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd.log",
            *TEST_CLUSTER_SETTINGS,
            node,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]))

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        self.write_conf()
        for name in DAEMONS:
            log = open(self.root / f"{name}.stdout", "w")
            self.procs[name] = subprocess.Popen([_daemon(name), "-D", "-f", str(self.conf)] +
                                                (["-i"] if name == "slurmctld" else []),
                                                env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)
            time.sleep(0.5)
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"slurm test cluster: {name} exited with {p.returncode}; see "
                                       f"{self.root}/{name}.log: {self.log_tail(name)}")
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            state = r.stdout.strip()
            if r.returncode == 0 and state in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"slurm test cluster: node not idle within {timeout:.0f} s (state {state!r}); "
                           f"slurmctld: {self.log_tail('slurmctld')} slurmd: {self.log_tail('slurmd')}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def cancel_all(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)

    def stop(self) -> None:
        """Cancel jobs, then SIGTERM the daemons (SIGKILL after 10 s) and reap them."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.cancel_all()
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                r = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True)
                if r.returncode or not r.stdout.strip():
                    break
                time.sleep(0.5)
        for name in reversed(DAEMONS):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
        for name in reversed(DAEMONS):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait(timeout=10)
