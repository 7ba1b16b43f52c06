"""algorithm.rollout_correction.bypass_mode through the in-process driver on real megatron-core models (CPU, gloo):
the actor's old-log-prob forward is skipped (counted on the real worker), the step's old log-probs ARE the rollout
log-probs (online: the sampler's; offline: the trajectory file's), ref and critic still run, the rollout correction
moves from the driver into the actor's loss (verl's rollout_corr/* metrics come from the update), and training
runs; with bypass_mode=false the driver recomputes as before."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from megatron_ppo.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_ppo import _overrides, data_dir  # noqa: E402,F401  (helpers and fixture reused)

RC = "algorithm.rollout_correction"


def _step(cfg):
    """One fit() step; returns (metrics, the step's batch as recorded, compute_log_probs calls per role, whether
    the actor's weights changed). The counters wrap the real workers' methods and call through."""
    from megatron_ppo import parallel
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    calls = {"actor": 0, "ref": 0}
    batches = []
    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        try:
            for role in calls:
                worker = getattr(parts, role).worker
                real = worker.compute_log_probs

                def counted(payload, _real=real, _role=role):
                    calls[_role] += 1
                    return _real(payload)
                worker.compute_log_probs = counted
            dump = parts.dumper

            def record(step, batch):
                batches.append(batch)
                if dump is not None:
                    dump(step, batch)
            parts.dumper = record
            before = {k: v.detach().clone() for k, v in parts.actor.worker.model.named_parameters()}
            metrics = PPOTrainer(cfg, parts).fit(1)[0]
            changed = any(not torch.equal(before[k], v.detach())
                          for k, v in parts.actor.worker.model.named_parameters())
        finally:
            parts.close()
    finally:
        parallel.destroy()
        disable_cpu_platform()
    return metrics, batches[0], calls, changed


CORRECTION = {f"{RC}.rollout_is": "token", f"{RC}.rollout_is_threshold": 2.0, f"{RC}.rollout_rs": "token_k1",
              f"{RC}.rollout_rs_threshold": 2.0}


def test_bypass_skips_the_actor_recompute_and_trains_on_the_rollout_log_probs(data_dir, tmp_path):
    m, batch, calls, changed = _step(load_config("tiny_cpu", _overrides(data_dir, tmp_path / "bypass", **{
        f"{RC}.bypass_mode": "true", **CORRECTION})))
    assert calls == {"actor": 0, "ref": 1}
    assert torch.equal(batch.tensors["old_log_probs"], batch.tensors["rollout_log_probs"])
    assert "ref_log_probs" in batch.tensors and "values" in batch.tensors
    # no driver-side correction: no weights, the loss mask is the response mask; the loss did it per micro-batch
    assert "rollout_is_weights" not in batch.tensors and torch.equal(batch.loss_mask, batch.response_mask)
    assert changed and m["actor/updates_skipped"] == 0 and math.isfinite(m["actor/pg_loss"])
    for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl",
                "rollout_corr/training_ppl", "actor/pg_clipfrac", "actor/ppo_kl", "critic/vf_loss"):
        assert key in m and math.isfinite(m[key]), key
    # step 1 starts on the rollout policy (IS weight 1, nothing rejected) and moves by one small update after
    # the first of the two mini-batches
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.05)
    assert "rollout/logprob_abs_diff_max" not in m and "actor/entropy_rollout" not in m

    m, batch, calls, changed = _step(load_config("tiny_cpu", _overrides(data_dir, tmp_path / "decoupled",
                                                                        **CORRECTION)))
    assert calls == {"actor": 1, "ref": 1}
    assert not torch.equal(batch.tensors["old_log_probs"], batch.tensors["rollout_log_probs"])  # recomputed
    assert m["rollout/logprob_abs_diff_max"] < 1e-4 and "actor/entropy_rollout" in m
    assert "rollout_is_weights" in batch.tensors and "rollout_corr/rollout_is_mean" in m and changed


def test_offline_bypass_reinforce_trains_on_the_stored_behaviour_log_probs(data_dir, tmp_path):
    from megatron_ppo.data.trajectory import TrajectoryDataset

    # the online step writes the trajectories (bypass on: the dump does not depend on it)
    _step(load_config("tiny_cpu", _overrides(data_dir, tmp_path / "online", **{
        f"{RC}.bypass_mode": "true", "rollout.dump_dir": str(tmp_path / "dump")})))
    files = sorted((tmp_path / "dump").glob("*.parquet"))
    stored = {tuple(item["response_ids"].tolist() if hasattr(item["response_ids"], "tolist")
                    else item["response_ids"]): item["rollout_log_probs"] for item in TrajectoryDataset(files)}
    m, batch, calls, changed = _step(load_config("tiny_cpu", _overrides(data_dir, tmp_path / "offline", **{
        "rollout.mode": "offline", "rollout.trajectory_files": f"[{files[0]}]", "data.train_files": "[]",
        f"{RC}.bypass_mode": "true", f"{RC}.loss_type": "reinforce", f"{RC}.rollout_is": "sequence",
        f"{RC}.rollout_is_threshold": 3.0})))
    assert calls == {"actor": 0, "ref": 1}
    lengths = batch.response_lengths.tolist()
    assert len(lengths) == len(stored) == 4
    for i, n in enumerate(lengths):
        logp = stored[tuple(batch.responses[i, :n].tolist())]
        torch.testing.assert_close(batch.tensors["old_log_probs"][i, :n], torch.as_tensor(logp), rtol=0, atol=0)
    assert torch.equal(batch.tensors["old_log_probs"], batch.tensors["rollout_log_probs"])
    assert changed and math.isfinite(m["actor/pg_loss"]) and "rollout_corr/rollout_is_seq_mean" in m
    assert "actor/pg_clipfrac" not in m  # reinforce has no clipping (verl logs none)
