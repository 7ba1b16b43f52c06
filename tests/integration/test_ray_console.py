"""Ray's own notes stay off the console (issue 15), while rank output and rank errors with their tracebacks still
reach it. A real local Ray cluster started by connect_or_start in a fresh driver process whose stdout is a pipe."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

DRIVER = """
from megatron_ppo import console
console.setup_logging()
from megatron_ppo.distributed.cluster import connect_or_start
import ray

cluster = connect_or_start(None, num_cpus=1)

@ray.remote(num_cpus=1)
class Rank:
    def hello(self):
        print("hello from the rank", flush=True)
        return 1

    def fail(self):
        raise ValueError("rank failure 1234")

rank = Rank.remote()
assert ray.get(rank.hello.remote()) == 1
try:
    ray.get(rank.fail.remote())
except Exception as exc:
    print("driver got:", exc, flush=True)
import time
time.sleep(1.5)  # the log monitor forwards the rank's output
cluster.shutdown()
print("driver done", flush=True)
"""

# what a `make train` console showed from Ray itself (and what Ray prints in other set-ups): none is news to a user
RAY_NOISE = (r"Token authentication", r"RAY_AUTH_MODE", r"Started a local Ray instance", r"[Uu]sage stats",
             r"metrics exporter", r"[Dd]ashboard", r"View the Ray dashboard", r"INFO worker\.py")


@pytest.mark.slow
def test_ray_console_has_rank_output_and_errors_but_no_ray_notes():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED", "RAY_COLOR_PREFIX", "RAY_enable_metrics_collection")}
    env.pop("MEGATRON_PPO_VERBOSE", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"^\(Rank pid=\d+\) hello from the rank$", proc.stdout, re.M), out  # no colour codes in a pipe
    assert "\x1b[3" not in proc.stdout.split("driver got:")[0], proc.stdout
    assert "driver got:" in out and "ValueError: rank failure 1234" in out and "in fail" in out, out  # the traceback
    assert "driver done" in proc.stdout
    noise = [line for line in out.splitlines() if any(re.search(p, line) for p in RAY_NOISE)]
    assert noise == [], noise
