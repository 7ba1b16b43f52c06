"""`megatron-ppo train` stopped by Ctrl-C or SIGTERM mid-run (issue 15, with issue 13's preemption semantics):
a short message, no traceback, and no process of the run's tree (Ray's processes included) left alive. Real
processes, real signals.

The SIGTERM run also checks the default thread rule (cluster.num_cpus_per_rank: auto): with one Ray rank per role and
no thread setting, each rank computes with every core of this machine (the roles share the bundle and take turns),
says so once per role at start-up and records it in layout.json. The old rule (num_cpus_per_rank defaulting to 1)
ran each rank on one thread whatever the machine had. (It shares this run to save CI a Ray run of its own.)

Both runs also check that the run removes every temp dir it made (issue 49): the ranks end by ray.kill, which ran
no exit handlers, and left wandb's ``tmp*wandb-*`` dirs (two per rank) and dist_checkpointing's ``pymp-*`` in
``$TMPDIR`` after an exit 0 as after Ctrl-C. Only torch's compile cache, reused by every run, may stay."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_ppo.testing.processes import process_tree, still_alive, wait_for_line

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [
    (signal.SIGINT, 130),
    # issue 13: SIGTERM finishes the step, saves, exits 0. On the Ray launcher this needs the driver to re-install
    # its handler after ray.init (Ray's C++ failure-signal handler replaces it and aborts the driver: rc -6).
    pytest.param(signal.SIGTERM, 0),
])
def test_train_signal_is_short_and_leaves_no_process(tmp_path, sig, code):
    one_rank_per_role = sig == signal.SIGTERM  # the thread rule's check (the module's docstring)
    layout = ["cluster.actor.tensor_model_parallel_size=1", "cluster.ref.tensor_model_parallel_size=1",
              "cluster.n_gpus_per_node=1"] if one_rank_per_role else []
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(key, None)
    # short and directly under /tmp (not CI's own $TMPDIR): Ray's session sockets live under it, AF_UNIX <= 107 bytes
    tmpdir = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))
    env["TMPDIR"] = str(tmpdir)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ppo.cli", "train", "trainer.total_training_steps=40",
                             "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.log_dir={tmp_path}/l",
                             f"trainer.default_local_dir={tmp_path}/ckpt", *layout], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    tree = []
    try:
        wait_for_line(proc, "step 1/")  # training runs
        tree = process_tree(proc.pid)
        assert len(tree) > 1  # Ray's processes and the ranks
        os.kill(proc.pid, sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        left = sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert proc.returncode == code, (proc.returncode, stderr[-2000:])
    assert left == [], f"temp dirs left in $TMPDIR: {left}"
    assert "Traceback" not in stderr, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("megatron-ppo train:")]
    assert 1 <= len(ours) <= 3 and signal.Signals(sig).name in ours[0], stderr[-2000:]
    deadline = time.monotonic() + 30
    while still_alive(tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert still_alive(tree) == [], "processes of the run still alive"
    if one_rank_per_role and len(os.sched_getaffinity(0)) >= 2:  # on one CPU auto and the old rule agree
        cpus = len(os.sched_getaffinity(0))
        roles = json.loads((tmp_path / "l" / "layout.json").read_text())["roles"]
        assert set(roles) == {"actor", "critic", "ref"}
        assert {role: r["torch_threads"] for role, r in roles.items()} == {role: [cpus] for role in roles}
        for role in roles:  # one start-up line per role names its threads
            assert f"{role}: TP=1 x PP=1 x DP=1 = 1 ranks on Ray, {cpus} torch thread(s) per rank" in stderr, \
                stderr[-3000:]
