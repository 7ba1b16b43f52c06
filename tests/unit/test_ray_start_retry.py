"""connect_or_start retries a local Ray start that hit Ray's fixed 30 s raylet-registration wait (a busy machine),
after killing what the failed start left behind -- and only those processes."""
from __future__ import annotations

import subprocess
import sys

from megatron_ppo.distributed import cluster


def test_only_the_children_started_after_the_snapshot_are_killed():
    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = cluster._child_pids()
        newer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        cluster._kill_new_children(before)
        newer.wait(timeout=10)  # killed (it would sleep 60 s; TimeoutExpired otherwise)
        assert older.poll() is None  # untouched
    finally:
        older.kill()
        older.wait()


def test_the_retry_is_for_the_raylet_start_timeout_only():
    ray_message = Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")
    assert cluster.is_raylet_start_timeout(ray_message)
    assert not cluster.is_raylet_start_timeout(ValueError("num_cpus must be positive"))
    assert cluster.LOCAL_START_ATTEMPTS >= 2
