"""The PPO driver on Ray worker groups (real Ray, real megatron-core ranks on gloo, CPU).

* Equivalence: one rollout batch, made by the in-process TP1 driver, goes through evaluate -> advantages ->
  critic and actor updates at (actor, critic) layouts TP2, PP2 and DP2 on Ray, from the same weights: old
  log-probs, values, first-step metrics (pg_loss, vf_loss, ppo_kl, grad norms) and the weights after the update
  equal the TP1 ones to fp32 tolerance.
* The target-KL guard: a forced KL spike skips every actor mini-batch on every rank alike (guard state identical
  on all ranks, weights unchanged on all ranks) at DP2 and PP2.
* Critic warmup on Ray: actor weights unchanged on every rank, critic trained; DP rollouts: replicas sample
  different tokens, and the same step reproduces them.
* Fail fast: kill -9 of one actor rank of a running `megatron-ppo train` ends it with a non-zero exit naming role,
  rank and node within 60 s, with no process left.
* A layout the cluster cannot host is refused before any process starts.

One Ray session for the module (build_groups reuses it).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_ppo import _overrides, data_dir  # noqa: E402,F401  (helpers and fixture reused)

from megatron_ppo.config import load_config  # noqa: E402
from megatron_ppo.testing.probes import PROBED_WORKERS, WorkerProbes  # noqa: E402
from megatron_ppo.workers.actor import ActorWorker  # noqa: E402
from megatron_ppo.workers.critic import CriticWorker  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {  # (actor, critic) cluster overrides on 2 ranks
    "TP2": {"cluster.actor.tensor_model_parallel_size": 2, "cluster.critic.tensor_model_parallel_size": 2},
    "PP2": {"cluster.actor.pipeline_model_parallel_size": 2, "cluster.critic.pipeline_model_parallel_size": 2},
    "DP2": {},
}
COMPARED = ("actor/pg_loss", "actor/ppo_kl", "actor/ppo_kl_k3", "actor/grad_norm", "actor/pg_clipfrac",
            "critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac")


class _FullState(WorkerProbes):
    """Test probes: the full (TP1/PP1) weights of this rank's model, gathered over TP and PP, and loading them."""

    def full_state_dict(self) -> dict:
        from megatron_ppo.testing.sharding import gather_full_state_dict

        return gather_full_state_dict(self.model)

    def load_full(self, full: dict) -> None:
        from megatron_ppo.testing.sharding import load_full_state_dict

        load_full_state_dict(self.model, full)


class ProbeActor(_FullState, ActorWorker):
    pass


class ProbeCritic(_FullState, CriticWorker):
    pass


PROBES = {"actor": ProbeActor, "critic": ProbeCritic}


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    from megatron_ppo.distributed import connect_or_start

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probes travel by value
    cluster = connect_or_start("local", num_cpus=4)
    yield cluster
    cluster.shutdown()


def _cfg(data_dir, tmp, launcher: str, **extra):
    over = {"actor.use_kl_loss": "false", "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 4,
            "actor.ppo_micro_batch_size_per_gpu": 1, "critic.ppo_mini_batch_size": 4,
            "critic.ppo_micro_batch_size_per_gpu": 1, "rollout.log_prob_micro_batch_size_per_gpu": 1,
            "actor.optim.lr": 1e-4, "critic.optim.lr": 1e-4, "actor.shuffle": "false", "critic.shuffle": "false",
            "algorithm.kl_guard.enable": "true", "algorithm.kl_guard.target_kl": 0.5,
            "cluster.launcher": launcher, **extra}
    if launcher == "ray":
        over["cluster.n_gpus_per_node"] = 2
    return load_config("tiny_cpu", _overrides(data_dir, tmp, **over))


def _prepare(trainer, batch):
    metrics: dict = {}
    trainer.evaluate(batch, metrics)
    trainer.compute_advantages(batch, metrics)
    return metrics


@pytest.fixture(scope="module")
def reference_step(data_dir, tmp_path_factory):
    """The in-process TP1 run: the rollout batch, the initial weights, the first-step metrics and the weights after."""
    from megatron_ppo.parallel.platform import disable_cpu_platform
    from megatron_ppo.testing.sharding import gather_full_state_dict
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    cfg = _cfg(data_dir, tmp_path_factory.mktemp("tp1"), "local")
    parts = build_components(cfg)
    try:
        trainer = PPOTrainer(cfg, parts)
        trainer.step = 1
        batch = trainer.rollout(parts.sampler.next_batch())
        trainer.score(batch, {})
        before = {r: gather_full_state_dict(getattr(parts, r).worker.model) for r in ("actor", "critic")}
        metrics = _prepare(trainer, batch)
        evaluated = {k: batch.tensors[k].clone() for k in ("old_log_probs", "values")}
        trainer.update_critic(batch, metrics)
        trainer.update_actor(batch, metrics)
        after = {r: gather_full_state_dict(getattr(parts, r).worker.model) for r in ("actor", "critic")}
    finally:
        parts.close()
        disable_cpu_platform()
    for key in ("old_log_probs", "values", "advantages", "returns"):  # the Ray runs recompute these
        batch.tensors.pop(key, None)
    return {"batch": batch, "before": before, "after": after, "metrics": metrics, "evaluated": evaluated}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ray_layouts_equal_the_in_process_tp1_step(name, ray_session, reference_step, data_dir, tmp_path):
    import copy

    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    ref = reference_step
    cfg = _cfg(data_dir, tmp_path, "ray", **LAYOUTS[name])
    parts = build_components(cfg, worker_classes=PROBES)
    try:
        actor, critic = parts.actor, parts.critic
        print(f"\n{name}: actor {actor.layout}, critic {critic.layout}")
        for role in ("actor", "critic"):
            getattr(parts, role).call_all("load_full", ref["before"][role])
        trainer = PPOTrainer(cfg, parts)
        trainer.step = 1
        batch = copy.deepcopy(ref["batch"])
        metrics = _prepare(trainer, batch)
        for key, want in ref["evaluated"].items():
            diff = float((batch.tensors[key] - want).abs().max())
            print(f"  {key}: max |diff| {diff:.2e}")
            assert diff < 1e-5, (name, key, diff)
        trainer.update_critic(batch, metrics)
        trainer.update_actor(batch, metrics)
        for key in COMPARED:
            print(f"  {key}: {metrics[key]:.8g} vs TP1 {ref['metrics'][key]:.8g}")
            assert metrics[key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), (name, key)
        for role in ("actor", "critic"):
            states = getattr(parts, role).call_all("full_state_dict")
            diff = max(_max_diff(s, ref["after"][role]) for s in states)  # every rank's gathered copy
            moved = _max_diff(ref["after"][role], ref["before"][role])
            print(f"  {role} weights after the update: max |diff| {diff:.2e} (the update moved them {moved:.2e})")
            assert moved > 1e-5 and diff < 1e-6, (name, role, diff)

        if name in ("DP2", "PP2"):  # a forced KL spike: every rank skips, and their guards agree
            sums = actor.call_all("checksum")
            spiked = copy.deepcopy(batch)
            spiked.tensors["old_log_probs"] = spiked.tensors["old_log_probs"] - 3.0 * spiked.response_mask
            spike: dict = {}
            trainer.update_actor(spiked, spike)
            assert spike["actor/updates_skipped_kl_guard"] == spike["actor/updates_skipped"] == 1, spike
            assert spike["actor/kl_guard_skips"] == 1 and spike["actor/ppo_kl_k3"] > 0.5
            guards = actor.call_all("guard_state")
            assert all(g == guards[0] for g in guards) and guards[0]["total_skips"] == 1, guards
            assert actor.call_all("checksum") == sums  # no rank moved

        if name == "DP2":  # rollouts: different tokens per replica, reproduced at the same step
            prompts = [0, 0, 0, 0]  # one prompt, 4 times: 2 rows per replica
            first = trainer.rollout(prompts)
            again = trainer.rollout(prompts)
            assert torch.equal(first.responses, again.responses)
            rows = [tuple(r.tolist()) for r in first.responses]
            assert len(set(rows)) > 1, "the DP replicas sampled the same tokens"
    finally:
        parts.close()


@pytest.mark.slow
def test_critic_warmup_on_ray_leaves_every_actor_rank_unchanged(ray_session, data_dir, tmp_path):
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    cfg = _cfg(data_dir, tmp_path, "ray", **{"trainer.critic_warmup": 1, "actor.use_kl_loss": "true",
                                             "cluster.actor.tensor_model_parallel_size": 2,
                                             "cluster.ref.tensor_model_parallel_size": 2,
                                             # the same run profiles its step in the driver and ranks 0, 1 of
                                             # every role (global_profiler: tests/integration/test_profiling.py)
                                             "global_profiler.tool": "torch", "global_profiler.steps": "[1]",
                                             "global_profiler.ranks": "[0,1]"})
    parts = build_components(cfg, worker_classes=PROBED_WORKERS)
    try:
        assert parts.ref.call_all("checksum") == parts.actor.call_all("checksum")  # the reference is the actor
        actor0, critic0 = parts.actor.call_all("checksum"), parts.critic.call_all("checksum")
        metrics = PPOTrainer(cfg, parts).fit(1)[0]
        assert parts.actor.call_all("checksum") == actor0
        critic1 = parts.critic.call_all("checksum")
        assert all(a != b for a, b in zip(critic1, critic0)) and critic1[0] == critic1[1]  # DP replicas agree
        assert "actor/pg_loss" not in metrics and metrics["critic/updates_skipped"] == 0
        assert 0 < metrics["timing/dispatch"] < metrics["timing/step"]  # serialisation + RPC + gather
        # a trace per profiled rank of every role, each with that rank's own calls named inside
        step1 = tmp_path / "logs" / "profile" / "step1"
        traces = sorted(p.name for p in step1.glob("*.pt.trace.json"))
        assert traces == [f"{t}.pt.trace.json" for t in ("actor_rank0", "actor_rank1", "critic_rank0", "critic_rank1",
                                                         "driver", "ref_rank0", "ref_rank1")], traces
        for tag, wanted in (("actor_rank1", ("actor/generate", "actor/forward_only", "actor/forward")),
                            ("critic_rank0", ("critic/update", "critic/forward_backward", "critic/optimizer_step")),
                            ("ref_rank1", ("ref/compute_log_probs",)), ("driver", ("ppo/gen", "ppo/update_critic"))):
            names = {e.get("name") for e in json.loads((step1 / f"{tag}.pt.trace.json").read_text())["traceEvents"]}
            assert set(wanted) <= names, (tag, sorted(n for n in names if n and "/" in n))
    finally:
        parts.close()


@pytest.mark.slow
def test_balance_batch_false_splits_every_dp_call_into_contiguous_rows(ray_session, data_dir, tmp_path, monkeypatch):
    """trainer.balance_batch=false decides the DP split of every call, forwards and updates alike: generation,
    old log-probs, values and both updates get contiguous blocks of rows on actor DP2 / critic DP2 (before, only
    the updates followed the key; call_rows always balanced tokens)."""
    from megatron_ppo.distributed import dispatch
    from megatron_ppo.distributed import group as group_module
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    calls = []

    def recording(where):
        def split(lengths, dp, balance=True):
            shards = dispatch.split_rows(lengths, dp, balance)
            calls.append((where, list(lengths), dp, balance, shards))
            return shards
        return split

    monkeypatch.setattr(group_module, "split_rows", recording("call_split"))  # the one DP split: forwards, updates
    methods, real_split = [], group_module.WorkerGroup.call_split

    def recording_split(self, method, *args, **kwargs):
        methods.append(method)
        return real_split(self, method, *args, **kwargs)

    monkeypatch.setattr(group_module.WorkerGroup, "call_split", recording_split)
    cfg = _cfg(data_dir, tmp_path, "ray", **{"trainer.balance_batch": "false", "trainer.val_before_train": "false"})
    parts = build_components(cfg)
    try:
        assert parts.actor.layout.dp == parts.critic.layout.dp == 2
        PPOTrainer(cfg, parts).fit(1)
    finally:
        parts.close()
    assert methods.count("update") == 2 and len(calls) == len(methods) >= 5, (methods, calls)
    for where, lengths, dp, balance, shards in calls:
        assert balance is False and dp == 2, (where, balance)
        assert shards == [list(range(len(lengths) // 2)), list(range(len(lengths) // 2, len(lengths)))], (where, shards)
    # not vacuous: a token-balanced split of the same rows differs from the contiguous one somewhere
    assert any(dispatch.split_rows(lengths, dp) != shards for _, lengths, dp, _, shards in calls), calls


def test_a_layout_the_cluster_cannot_host_is_refused_before_anything_starts(capsys):
    from megatron_ppo.errors import UsageError
    from megatron_ppo.trainer.entry import main

    with pytest.raises(UsageError, match=re.escape("critic TP=1 x PP=1 x DP=4 = 4 ranks but the cluster offers 2 "
                                                   "CPU slots (cluster.nnodes x cluster.n_gpus_per_node = 1 x 2)")):
        main(["cluster.critic.data_parallel_size=4", "critic.ppo_micro_batch_size_per_gpu=1"])


# ---------------------------------------------------------------------------------------------- fail fast

def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@pytest.mark.slow
def test_kill_9_of_an_actor_rank_ends_the_run_naming_it_with_nothing_left(data_dir, tmp_path):
    import psutil

    overrides = _overrides(data_dir, tmp_path, **{
        "cluster.launcher": "ray", "cluster.n_gpus_per_node": 2, "cluster.actor.tensor_model_parallel_size": 2,
        "cluster.ref.tensor_model_parallel_size": 2, "trainer.total_training_steps": 200,
        "critic.ppo_micro_batch_size_per_gpu": 1, "trainer.logger": "[console]"})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ppo.cli", "train", *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, victim, tree = [], None, []
    try:
        deadline = time.monotonic() + 400
        for line in proc.stdout:  # rank output is prefixed "(actor[tp1 pp0 dp0] pid=N)"
            lines.append(line)
            m = re.search(r"actor\[tp1 pp0 dp0\] pid=(\d+)", line) or re.search(
                r"actor: .* up in .* rank pids \[\d+, (\d+)\]", line)  # rank 1's pid, from the start-up line
            if m:
                victim = int(m.group(1))
            if line.startswith("step 1/") and victim:  # the console line: "step 1/N ..."
                break
            assert time.monotonic() < deadline, "".join(lines[-50:])
        assert victim and psutil.pid_exists(victim), "".join(lines[-50:])
        tree = _descendants(proc.pid)
        assert victim in [p.pid for p in tree]
        time.sleep(0.3)  # inside step 2
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        rest, _ = proc.communicate(timeout=90)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    print(f"\nkill -9 of actor rank 1 (pid {victim}) -> exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode != 0
    assert took < 60, took
    assert re.search(r"actor rank 1 \(tp1 pp0 dp0\) on node \S+ pid %d died" % victim, out), out[-3000:]
    assert "megatron-ppo train: stopped: actor rank 1 (tp1 pp0 dp0)" in out
    time.sleep(1)
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.name()) for p in left]
