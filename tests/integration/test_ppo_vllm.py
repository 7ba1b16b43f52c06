"""PPO through `megatron-ppo train` with rollout.name=vllm (real vLLM, its own venv): the default tiny run's TP2 actor
on Ray syncs into one vLLM engine every step and stays on-policy (rollout vs recomputed log-probs within 1e-4 every
step while the actor learns at lr 1e-2), and so does a DP2 actor with an engine per replica; the engine killed
mid-run ends the run within 60 s with a line naming the engine and replica, and no process of the run is left (the
TP2 on-policy check and the kill share one run: a vLLM run costs ~1.5 min of CI). Tests of the engine alone:
test_rollout_vllm.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_ppo.testing.processes import process_tree, still_alive, wait_for_line

sys.path.insert(0, str(Path(__file__).parent))
from vllm_env import vllm_python  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _command(tmp: Path, steps: int, extra: tuple = ()) -> list[str]:
    # head dim 32 (vLLM's CPU attention has no 16, the default tiny model's): 2 heads of the 64-wide model
    return [sys.executable, "-m", "megatron_ppo.cli", "train", "--config", "configs/tiny_cpu.yaml",
            "rollout.name=vllm", f"rollout.vllm.python={vllm_python()}", "rollout.vllm.cpu_kv_cache_gib=0.25",
            f"rollout.vllm.weights_dir={tmp}/shm", "actor.model.arch.num_attention_heads=2",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            f"trainer.log_dir={tmp}/logs", f"trainer.default_local_dir={tmp}/ckpt", "trainer.save_freq=-1",
            f"data.preprocess.output_dir={tmp}/data", f"data.train_files=[{tmp}/data/train.parquet]",
            f"data.val_files=[{tmp}/data/test.parquet]", *extra]


def _engines() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any("mppo_vllm_server.py" in part for part in (p.info["cmdline"] or [])):
            out.append(p)
    return out


def _check_on_policy(steps: list[dict]) -> None:
    """The engine's log-probs are the actor's (within 1e-4) every step, its weights were synced every step, and the
    actor moved (lr 1e-2), so a sync that silently kept the old weights would show."""
    for s in steps:
        assert s["rollout/logprob_abs_diff_max"] <= 1e-4, (s["step"], s["rollout/logprob_abs_diff_max"])
        assert s["timing/sync_weights"] > 0
    assert max(abs(s["actor/pg_clipfrac"]) + abs(s["actor/ppo_kl"]) for s in steps) > 0  # the actor did move


def _steps(logs: Path) -> list[dict]:
    return [s for s in map(json.loads, (logs / "metrics.jsonl").open()) if "timing/step" in s]


def test_ppo_with_vllm_stays_on_policy_an_engine_per_dp_replica(tmp_path):
    """Actor DP2 -> an engine per replica, a whole run: on-policy every step, each engine's log, and nothing left
    (the weight directory, the engines). The TP2 -> one engine layout runs in the killed-engine test below."""
    extra = ("cluster.actor.tensor_model_parallel_size=1", "cluster.ref.tensor_model_parallel_size=1",
             "actor.ppo_micro_batch_size_per_gpu=4")
    run = subprocess.run(_command(tmp_path, 4, extra), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = _steps(tmp_path / "logs")
    assert len(steps) == 4
    _check_on_policy(steps)
    logs = sorted(p.name for p in (tmp_path / "logs").glob("vllm-engine-dp*.log"))
    assert logs == ["vllm-engine-dp0.log", "vllm-engine-dp1.log"], logs
    assert all((tmp_path / "logs" / name).stat().st_size > 0 for name in logs)
    assert not any((tmp_path / "shm").iterdir())  # the engine's weight directory went with it
    assert not _engines()


def _start_until_step(tmp: Path, step: int) -> tuple[subprocess.Popen, Path]:
    """The TP2 run (200 steps) started and read until step ``step`` is printed. Known intermittent failure (once in
    a local CI run of this layout, cause not found, issue 25's note): a run that ends before is printed and a second
    attempt in a fresh directory must get there."""
    for attempt in (tmp, tmp / "second"):
        proc = subprocess.Popen(_command(attempt, 200), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            wait_for_line(proc, f"step {step}/")
            return proc, attempt / "logs"
        except AssertionError as e:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            if attempt != tmp:
                raise
            print(f"first attempt failed: {e}")
    raise AssertionError("unreachable")


def test_tp2_on_policy_then_a_killed_engine_ends_the_run_within_60_s_naming_it(tmp_path):
    """Actor TP2 -> one engine: on-policy for the first 4 steps; then the engine is killed and the run ends within
    60 s with a line naming the engine and its replica, and no process of the run is left. Then the same layout with
    trainer.async_rollout=one_step at max_staleness=0 repeats the first 3 steps exactly (test_ppo_one_step.py tests
    the mode at staleness 1; sharing this run saves a vLLM run of CI)."""
    proc, logs = _start_until_step(tmp_path, 5)
    tree = []
    try:
        steps = _steps(logs)[:4]
        assert [s["step"] for s in steps] == [1, 2, 3, 4], steps
        _check_on_policy(steps)
        tree = process_tree(proc.pid)
        engines = [p for p in _engines() if p.pid in {q.pid for q in tree}]
        assert len(engines) == 1, engines
        engines[0].kill()
        killed = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode not in (0, None)
    assert took < 60, took
    # killed inside a call: "died during 'generate'"; between calls: the next one finds it "is not running (exit
    # code -9, signal SIGKILL)"
    assert "vLLM engine of actor replica dp0" in stderr and ("died" in stderr or "is not running" in stderr), \
        stderr[-3000:]
    time.sleep(2)
    assert still_alive(tree) == [], still_alive(tree)
    # trainer.async_rollout=one_step at max_staleness=0 is this synchronous run, metric for metric (its rollouts go
    # through the engine's submit / collect; constant lr: the 200-step run's first steps do not depend on its length)
    zero_dir = tmp_path / "one_step_zero"
    zero = subprocess.run(_command(zero_dir, 3, ("trainer.async_rollout=one_step", "trainer.max_staleness=0")),
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert zero.returncode == 0, zero.stderr[-3000:]
    zero_steps = _steps(zero_dir / "logs")
    assert [s["step"] for s in zero_steps] == [1, 2, 3]
    for sync_step, zero_step in zip(steps[:3], zero_steps):
        assert zero_step["rollout/staleness_max"] == 0.0
        keys = {k for k in (*sync_step, *zero_step) if not k.startswith(("timing/", "perf/", "rollout/staleness"))}
        diff = {k: (sync_step.get(k), zero_step.get(k)) for k in sorted(keys) if sync_step.get(k) != zero_step.get(k)}
        assert diff == {}, (sync_step["step"], diff)
