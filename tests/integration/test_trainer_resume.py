"""Trainer checkpoints, resume and preemption on real megatron-core models (CPU, gloo), real parquet data.

Bit-exactness: a run stopped at step k (checkpoint saved) and resumed by a freshly built trainer must log, for
every step after k, exactly (==) the metrics of the uninterrupted run, except wall-clock ones (WALL_CLOCK:
timing/*, perf/tokens_per_s, perf/throughput, perf/rollout_tokens_per_s, perf/mfu/*). The resumed trainer is built
with OTHER constructor arguments where the checkpoint must win (the KL controller's init coefficient, the actor's
lr), so a field the checkpoint forgets fails the comparison.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_ppo.config import load_config

REPO = Path(__file__).resolve().parents[2]
TOTAL = 5  # 12 prompts / 4 per batch: steps 1-3 are epoch 0, 4-5 epoch 1


def _overrides(data_dir: Path, tmp: Path, **extra) -> list[str]:
    base = {
        "data.preprocess.dataset": "gsm8k", "data.preprocess.tokenizer_vocab_size": 2048,
        "data.preprocess.output_dir": str(data_dir),
        "data.train_files": f"[{data_dir}/train.parquet]", "data.val_files": f"[{data_dir}/test.parquet]",
        "data.max_prompt_length": 256, "data.train_batch_size": 4, "data.train_max_samples": 12,
        "data.val_max_samples": 4, "data.max_response_length": 8,
        "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size_per_gpu": 2,
        "critic.ppo_mini_batch_size": 2, "critic.ppo_micro_batch_size_per_gpu": 2,
        # the driver's state that a resume must carry: an adaptive KL controller, the target-KL guard's counters
        "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.05,
        "algorithm.kl_guard.enable": True, "algorithm.kl_guard.target_kl": 100.0,
        "actor.optim.lr_warmup_steps": 2, "actor.optim.lr_decay_style": "cosine", "actor.optim.min_lr": 1e-6,
        "trainer.total_training_steps": TOTAL, "trainer.test_freq": -1, "trainer.val_before_train": False, "trainer.logger": "[jsonl]",
        "trainer.log_dir": str(tmp / "logs"), "trainer.default_local_dir": str(tmp / "ckpt"),
        "cluster.launcher": "local", "cluster.n_gpus_per_node": 1,
        "cluster.actor.tensor_model_parallel_size": 1, "cluster.ref.tensor_model_parallel_size": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# metrics that measure the wall clock (or the allocator): equal runs differ in them
WALL_CLOCK = ("timing/", "perf/tokens_per_s", "perf/throughput", "perf/rollout_tokens_per_s", "perf/mfu/",
              "perf/max_memory_")


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK)}


def _scramble_rng() -> None:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({name: torch.Generator().manual_seed(i).get_state()
                        for i, name in enumerate(tracker.get_states())})


def _assert_same_rng(a: dict, b: dict) -> None:
    assert a["python"] == b["python"]
    assert torch.equal(a["numpy"][1], b["numpy"][1]) and a["numpy"][2:] == b["numpy"][2:]
    assert torch.equal(a["torch"], b["torch"])
    assert a["tracker"].keys() == b["tracker"].keys() and a["tracker"]
    assert all(torch.equal(a["tracker"][k], b["tracker"][k]) for k in a["tracker"])


def _run(cfg, steps: int, resume: str | None = None, before_fit=None, after_fit=None):
    """Build a trainer in this process (a fresh Megatron world), optionally resume, fit to ``steps``."""
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg, resuming=resume is not None)
        try:
            trainer = PPOTrainer(cfg, parts)
            if resume:
                _scramble_rng()  # a new process's history differs: whatever it drew must not matter
                trainer.resume(resume)
            if before_fit:
                before_fit(trainer)
            history = trainer.fit(steps)
            if after_fit:
                after_fit(trainer)
            weights = {k: v.detach().clone() for k, v in parts.actor.worker.model.named_parameters()}
            return trainer, history, weights
        finally:
            parts.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume_data")


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """The uninterrupted run: TOTAL steps, no checkpoint."""
    tmp = tmp_path_factory.mktemp("straight")
    _, history, weights = _run(load_config("tiny_cpu", _overrides(data_dir, tmp)), TOTAL)
    return history, weights


@pytest.mark.slow
@pytest.mark.parametrize("stop", [2, 3], ids=["mid-epoch", "epoch-edge"])
def test_resume_continues_the_uninterrupted_run_bit_exactly(data_dir, tmp_path, straight, stop, caplog):
    from megatron_ppo.trainer import checkpoint as ckpt

    from megatron_ppo.parallel.rng_state import capture_rng

    history, weights = straight
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{"trainer.save_freq": stop}))
    rngs = []
    with caplog.at_level(logging.INFO, logger="megatron_ppo"):
        first, _, _ = _run(cfg, stop, after_fit=lambda trainer: rngs.append(capture_rng()))
    # every role's ranks return their free heap before a save, not only the saving role (host memory is shared)
    released = [r.getMessage() for r in caplog.records if "gave back free heap" in r.getMessage()]
    assert len(released) == 1 and all(f"{role} " in released[0] for role in ("actor", "critic", "ref")), released
    saved = ckpt.find_resume(cfg.trainer)
    assert saved == str(tmp_path / "ckpt" / f"global_step_{stop}")
    assert (tmp_path / "ckpt" / ckpt.LATEST_FILE).read_text().strip() == str(stop)
    sampler = json.loads((Path(saved) / ckpt.DRIVER_STATE).read_text())["sampler"]
    assert sampler["num_rows"] == 12, "the data changed: steps 1-3 must be one epoch"
    assert (sampler["epoch"], sampler["position"]) == ((0, 8) if stop == 2 else (1, 0))

    # other constructor arguments: the checkpoint's values must win
    other = load_config("tiny_cpu", _overrides(data_dir, tmp_path / "resumed", **{
        "algorithm.kl_ctrl.kl_coef": 0.9, "actor.optim.lr": 3e-3}))
    resumed, tail, resumed_weights = _run(other, TOTAL, resume=saved,
                                          before_fit=lambda trainer: rngs.append(capture_rng()))
    # every RNG of the process (python, numpy, torch, Megatron's tracker) is where the first run left it (the tiny
    # model has no dropout and generation seeds come from the step, so the metrics alone would not show this)
    _assert_same_rng(*rngs)
    assert resumed.step == TOTAL and len(tail) == TOTAL - stop
    for expected, got in zip(history[stop:], tail):
        assert _comparable(got) == _comparable(expected)
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)
    assert "actor/kl_coef" in tail[0] and "actor/kl_guard_skips_total" in tail[0]


@pytest.mark.slow
def test_a_save_inside_critic_warmup_resumes_bit_exactly(data_dir, tmp_path):
    """The actor's optimizer has never stepped at a save inside trainer.critic_warmup (megatron-core asserted on
    its missing Adam step: a SmolLM2 dumping run died at its only save); the saved state is a fresh Adam's, and the
    run resumed from it equals the uninterrupted one, actor updates after the warmup included."""
    from megatron_ppo.trainer import checkpoint as ckpt

    warm = {"trainer.critic_warmup": 2}
    _, history, weights = _run(load_config("tiny_cpu", _overrides(data_dir, tmp_path / "straight", **warm)), TOTAL)
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **warm, **{"trainer.save_freq": 2}))
    _run(cfg, 2)
    saved = ckpt.find_resume(cfg.trainer)
    assert saved == str(tmp_path / "ckpt" / "global_step_2")
    _, tail, resumed_weights = _run(cfg, TOTAL, resume=saved)
    assert "actor/pg_loss" not in history[1] and "actor/pg_loss" in history[2]  # steps 1-2 warm the critic only
    for expected, got in zip(history[2:], tail):
        assert _comparable(got) == _comparable(expected)
    assert all(torch.equal(weights[k], resumed_weights[k]) for k in weights)


@pytest.mark.slow
def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint(data_dir, tmp_path, monkeypatch):
    """The save of step 2 dies after the model shards are written (before the driver state): global_step_1 stays
    the one resume_mode=auto picks, and resuming from it works; the next save removes the leftover."""
    from megatron_ppo.trainer import checkpoint as ckpt

    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **{"trainer.save_freq": 1,
                                                                     "trainer.max_actor_ckpt_to_keep": 2,
                                                                     "trainer.max_critic_ckpt_to_keep": 1}))
    real = ckpt.write_driver_state

    def crash_at_step_2(tmp, state, rng):
        if state["step"] == 2:
            raise KeyboardInterrupt("killed in the middle of the save")
        return real(tmp, state, rng)

    monkeypatch.setattr(ckpt, "write_driver_state", crash_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, 2)
    monkeypatch.setattr(ckpt, "write_driver_state", real)
    root = tmp_path / "ckpt"
    leftovers = [p for p in root.iterdir() if p.name.startswith("global_step_2.tmp-")]
    assert leftovers and (leftovers[0] / "actor" / "metadata.json").is_file()  # the shards were written
    assert ckpt.complete_steps(str(root)) == [1]
    assert ckpt.find_resume(cfg.trainer) == str(root / "global_step_1")

    trainer, history, _ = _run(cfg, 3, resume=ckpt.find_resume(cfg.trainer))
    assert [h for h in history] and trainer.step == 3 and len(history) == 2
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    # pruning: actor keeps the newest 2 (steps 2, 3), critic the newest 1 (step 3); step 1 lost both: gone
    assert ckpt.complete_steps(str(root)) == [2, 3]
    assert (root / "global_step_2" / "actor").is_dir() and not (root / "global_step_2" / "critic").exists()
    assert (root / "global_step_3" / "critic").is_dir()


def test_resume_path_must_be_a_complete_checkpoint(tmp_path):
    from megatron_ppo.trainer import checkpoint as ckpt

    (tmp_path / "global_step_4").mkdir()
    cfg = load_config("tiny_cpu", ["trainer.resume_mode=resume_path",
                                   f"trainer.resume_from_path={tmp_path / 'global_step_4'}"])
    with pytest.raises(ckpt.CheckpointError, match="trainer.resume_from_path=.*not a complete checkpoint"):
        ckpt.find_resume(cfg.trainer)


def _train_cmd(data_dir: Path, tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_ppo.cli", "train", *_overrides(data_dir, tmp), *extra]


def _records(tmp: Path) -> list[dict]:
    path = tmp / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_preemption_signals_save_exit_0_and_each_new_process_resumes_bit_exactly(data_dir, tmp_path, straight):
    """SIGUSR1 (what Slurm's --signal=USR1 sends before a time limit) during step 2, then SIGTERM during the resumed
    run's next step: each time the step finishes, a checkpoint is written, exit 0; rerunning the command resumes, and
    the three processes together repeat the uninterrupted run exactly (``straight``: the same config in-process)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run_dir = tmp_path / "run"
    cmd = _train_cmd(data_dir, run_dir)  # TOTAL steps, as ``straight``
    done = 0
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 600
        while len(_records(run_dir)) < done + 1 and proc.poll() is None and time.time() < deadline:  # its 1st step
            time.sleep(0.05)
        proc.send_signal(sig)  # during the process's second step
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        before, done = done, len(_records(run_dir))
        assert before + 1 <= done < TOTAL, f"{sig.name} came too late to test anything"
        assert f"{sig.name}: finishing the current step" in err and f"stopped by {sig.name} after step {done}" in out
        assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(done)

    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    records, (expected, _) = _records(run_dir), straight
    assert [r["step"] for r in records] == list(range(1, TOTAL + 1))  # each step once, from three processes
    for got, want in zip(records, expected):  # a record is the step's metrics and its number
        assert {k: v for k, v in _comparable(got).items() if k != "step"} == _comparable(want)


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once(data_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_train_cmd(data_dir, tmp_path, "trainer.total_training_steps=50"), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while len(_records(tmp_path)) < 1 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM again: exiting now" in err and "Traceback" not in err


class _FullWeights:
    """A probe mixed into a role's worker: its full (TP1/PP1) weights, gathered over TP and PP."""

    def full_state_dict(self) -> dict:
        from megatron_ppo.testing.sharding import gather_full_state_dict

        return gather_full_state_dict(self.model)


def _probe_classes(role: str = "actor"):
    from megatron_ppo.workers.actor import ActorWorker
    from megatron_ppo.workers.critic import CriticWorker

    base = {"actor": ActorWorker, "critic": CriticWorker}[role]
    return {role: type(f"Full{base.__name__}", (_FullWeights, base), {"__module__": __name__})}


SAVED_LAYOUTS = {  # 2 Ray ranks: the trained roles split over both by TP (PP2: the critic's, in the same-layout test
    # below, which shares its Ray run)
    "TP2": {"cluster.actor.tensor_model_parallel_size": 2, "cluster.critic.tensor_model_parallel_size": 2,
            "cluster.ref.tensor_model_parallel_size": 2},
}


def _continues_at_tp1_pp1(data_dir, tmp: Path, checkpoint: Path, saved: dict, role: str = "actor") -> None:
    """Resumed in-process at TP1/PP1 from ``checkpoint``: the role's weights equal ``saved`` (a Ray rank's full
    state dict at the saving layout) before the next step, and the run continues."""
    from megatron_ppo.testing.sharding import gather_full_state_dict

    def compare(trainer):
        got = gather_full_state_dict(getattr(trainer.p, role).worker.model)
        assert got.keys() == saved.keys()
        assert all(torch.equal(got[k], saved[k]) for k in got)
        assert trainer.step == 2

    local = load_config("tiny_cpu", _overrides(data_dir, tmp))
    trainer, history, _ = _run(local, 3, resume=str(checkpoint), before_fit=compare)
    assert trainer.step == 3 and len(history) == 1


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SAVED_LAYOUTS))
def test_resume_at_another_layout_continues_with_equal_weights(data_dir, tmp_path, layout):
    """Saved by Ray ranks at actor/critic TP2, resumed in-process at TP1: the weights (and the optimizer state, which
    the next update uses) reshard; the run continues. RNG streams are not comparable across layouts. (PP2 -> PP1: the
    same-layout test's critic.)"""
    ray = pytest.importorskip("ray")
    from megatron_ppo.distributed import connect_or_start
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    two = {"cluster.launcher": "ray", "cluster.n_gpus_per_node": 2, **SAVED_LAYOUTS[layout], "trainer.save_freq": 2}
    cfg = load_config("tiny_cpu", _overrides(data_dir, tmp_path, **two))
    cluster = connect_or_start("local", num_cpus=4)
    try:
        parts = build_components(cfg, worker_classes=_probe_classes())
        try:
            assert parts.actor.layout.tp * parts.actor.layout.pp == 2 and parts.actor.layout.dp == 1
            trainer = PPOTrainer(cfg, parts)
            trainer.fit(2)
            saved = parts.actor.call_all("full_state_dict")
        finally:
            parts.close()
    finally:
        cluster.shutdown()
    assert all(torch.equal(saved[0][k], s[k]) for s in saved for k in s)
    _continues_at_tp1_pp1(data_dir, tmp_path / "tp1", tmp_path / "ckpt" / "global_step_2", saved[0])


# actor and reference DP2 (each replica generates and trains its own rows; the reference must match the actor's
# layout), critic PP2 (one layer a stage): one Ray run for both kinds (CI time; they were two tests of ~110 s). A
# resume that drops the optimizer state fails it (planted); the ranks' RNG restore does not show in these metrics
# (generation seeds come from the step; the in-process test above compares the RNG states themselves).
RAY_LAYOUT = {"actor.ppo_micro_batch_size_per_gpu": 1, "cluster.critic.pipeline_model_parallel_size": 2}
RAY_SHAPES = {"actor": (1, 1, 2), "critic": (1, 2, 1), "ref": (1, 1, 2)}  # (tp, pp, dp)


@pytest.mark.slow
def test_resume_on_ray_at_the_same_layout_is_bit_exact(data_dir, tmp_path):
    """Ray ranks (actor and reference DP2, critic PP2): 4 straight steps (saving at step 2) vs a resume from that
    step's checkpoint in new groups. The checkpoint is also resumed in-process at PP1 (``_continues_at_tp1_pp1``): the
    critic weights the resumed PP2 ranks hold equal the PP1 ones."""
    ray = pytest.importorskip("ray")
    from megatron_ppo.distributed import connect_or_start
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    two = {"cluster.launcher": "ray", "cluster.n_gpus_per_node": 2, "trainer.total_training_steps": 4, **RAY_LAYOUT}
    held = {}

    def run(tmp, steps, save_freq=-1, resume=None):
        cfg = load_config("tiny_cpu", _overrides(data_dir, tmp, **two, **{"trainer.save_freq": save_freq}))
        probe = resume is not None
        parts = build_components(cfg, resuming=probe, worker_classes=_probe_classes("critic") if probe else None)
        try:
            trainer = PPOTrainer(cfg, parts)
            for name, shape in RAY_SHAPES.items():
                role = getattr(parts, name)
                assert (role.layout.tp, role.layout.pp, role.layout.dp) == shape, name
            if resume:
                _scramble_rng()  # a new process's history differs: whatever it drew must not matter
                trainer.resume(resume)
                held["weights"] = parts.critic.call_all("full_state_dict")[0]
            return trainer.fit(steps)
        finally:
            parts.close()

    checkpoint = tmp_path / "straight" / "ckpt" / "global_step_2"
    cluster = connect_or_start("local", num_cpus=4)
    try:  # the straight run saves at step 2 and goes on: a save that shifted its random streams would fail this too
        straight = run(tmp_path / "straight", 4, save_freq=2)
        tail = run(tmp_path / "resumed", 4, resume=str(checkpoint))
    finally:
        cluster.shutdown()
    assert len(tail) == 2
    for expected, got in zip(straight[2:], tail):
        assert _comparable(got) == _comparable(expected)
    _continues_at_tp1_pp1(data_dir, tmp_path / "pp1", checkpoint, held["weights"], role="critic")


def _fake_checkpoint(root: Path, step: int, roles=("actor", "critic"), complete=True) -> Path:
    from megatron_ppo.trainer import checkpoint as ckpt

    d = root / f"global_step_{step}"
    for role in roles:
        (d / role).mkdir(parents=True)
    if complete:
        (d / ckpt.DRIVER_STATE).write_text("{}")
    return d


def test_auto_resume_takes_the_newest_complete_checkpoint_whatever_the_pointer_says(tmp_path):
    """A crash after the rename but before the pointer: the pointer lags, the complete dir wins; an unfinished
    tmp dir and a dir without driver_state.json are never chosen."""
    from megatron_ppo.trainer import checkpoint as ckpt

    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4)
    _fake_checkpoint(root, 6, complete=False)
    (root / "global_step_8.tmp-123" / "actor").mkdir(parents=True)
    (root / ckpt.LATEST_FILE).write_text("2\n")
    cfg = load_config("tiny_cpu", [f"trainer.default_local_dir={root}"])
    assert ckpt.find_resume(cfg.trainer) == str(root / "global_step_4")
    assert ckpt.resume_step(ckpt.find_resume(cfg.trainer)) == 4
    assert ckpt.find_resume(load_config("tiny_cpu", [f"trainer.default_local_dir={root}",
                                                     "trainer.resume_mode=disable"]).trainer) is None
    assert ckpt.find_resume(load_config("tiny_cpu", [f"trainer.default_local_dir={tmp_path / 'none'}"]).trainer) is None


def test_prune_keeps_the_newest_per_role_and_never_the_current(tmp_path):
    from megatron_ppo.trainer import checkpoint as ckpt

    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    gone = ckpt.prune(str(tmp_path), {"actor": 2, "critic": 1}, current=4)
    assert ckpt.complete_steps(str(tmp_path)) == [3, 4]
    assert sorted(p.name for p in (tmp_path / "global_step_3").iterdir() if p.is_dir()) == ["actor"]
    assert sorted(p.name for p in (tmp_path / "global_step_4").iterdir() if p.is_dir()) == ["actor", "critic"]
    assert len(gone) == 2 + 3 + 2  # actor of 1, 2; critic of 1, 2, 3; then the emptied dirs 1 and 2
    gone = ckpt.prune(str(tmp_path), {"actor": 1, "critic": None}, current=4)
    assert gone == [str(tmp_path / "global_step_3" / "actor"), str(tmp_path / "global_step_3")]
    assert ckpt.complete_steps(str(tmp_path)) == [4]
