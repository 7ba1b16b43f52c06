"""A rank's torch threads are the CPUs it really has (cluster.num_cpus_per_rank: auto, the default): `megatron-ppo
train` on Ray with one rank per role and no thread setting computes with every core of this machine on each rank
(the roles share the bundle and take turns), says so once per role at start-up and records it in layout.json.
The old rule (num_cpus_per_rank defaulting to 1) ran each rank on one thread whatever the machine had."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_ppo import _overrides, data_dir  # noqa: E402,F401  (helpers and fixture reused)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: auto and the old rule agree")
def test_default_threads_are_the_machine_cpus_per_rank_on_ray(data_dir, tmp_path):
    cpus = len(os.sched_getaffinity(0))
    overrides = [o for o in _overrides(data_dir, tmp_path) if not o.startswith("cluster.launcher=")]
    overrides += ["cluster.launcher=ray", "trainer.total_training_steps=1"]
    assert not any(o.startswith("cluster.num_cpus_per_rank") for o in overrides)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key in ("RAY_ADDRESS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "megatron_ppo.cli", "train", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    roles = json.loads((tmp_path / "logs" / "layout.json").read_text())["roles"]
    assert set(roles) == {"actor", "critic", "ref"}
    assert {role: r["torch_threads"] for role, r in roles.items()} == {role: [cpus] for role in roles}, out[-2000:]
    for role in roles:  # one start-up line per role names its threads
        assert f"{role}: TP=1 x PP=1 x DP=1 = 1 ranks on Ray, {cpus} torch thread(s) per rank" in out, out[-3000:]
