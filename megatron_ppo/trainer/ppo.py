"""The PPO driver loop: rollout -> score -> evaluate -> advantage -> update -> sync weights -> record, one named
method a phase.

The driver talks only to worker groups (trainer/groups.py: Ray ranks or one in-process rank per role) and to the
rollout source (rollout/source.py: online or offline): it sends data and the step number and gets back per-row
results (``call_rows``: split over the DP replicas by tokens, returned in row order) or one replica's global answer
(``call_split``: the same split; the workers reduce over DP themselves). Rewards, advantages and the KL controller
stay here; the PPO epochs x mini-batches loop, the losses and the target-KL guard run inside the workers
(workers/actor.py, critic.py, workers/losses.py).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from megatron_ppo.algo.advantages import compute_gae_advantage_return, compute_grpo_outcome_advantage, masked_mean, masked_whiten
from megatron_ppo.algo.kl_control import apply_kl_penalty
from megatron_ppo.algo.losses import explained_variance
from megatron_ppo.algo.rollout_correction import compute_rollout_correction_and_rejection_mask
from megatron_ppo.config import to_yaml
from megatron_ppo.data.batch import RolloutBatch, chunk_rows
from megatron_ppo.rewards.batch import score_responses
from megatron_ppo import console, ops, perf, profiling, roles
from megatron_ppo.trainer import checkpoint as ckpt
from megatron_ppo.trainer import progress
from megatron_ppo.trainer.best import BestValidation, validation_score
from megatron_ppo.trainer.progress import BatchProgress
from megatron_ppo.trainer.tracking import timed

log = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """trainer.max_consecutive_skips steps in a row had updates skipped for a non-finite loss or gradient norm."""


class PPOTrainer:
    def __init__(self, cfg, parts):
        """parts: a trainer.components.Components (worker groups, datasets, sampler, tokenizer, scorer, KL controller)."""
        self.cfg, self.p = cfg, parts
        self.step = 0
        self.best = BestValidation()  # trainer.save_best: the best validated step so far
        self.nonfinite_streak: dict[str, int] = {}  # role -> consecutive steps with a non-finite update skipped
        self.nonfinite_detail: dict[str, str] = {}  # role -> the offending values of its latest such step
        self.stop_requested = None  # a callable -> the signal name when preemption asks to stop (entry.py), or None
        self.resumed_from: str | None = None
        self.policy_version = 0  # actor updates so far: the version of the weights the engine generates with
        self.next_batch: RolloutBatch | None = None  # generated ahead (trainer.async_rollout=one_step)
        g = cfg.global_profiler
        self.profiler = profiling.StepProfiler(g.tool, g.steps, profiling.save_root(cfg), "driver")
        self.peak_flops: float | None = None  # MFU's peak per GPU, asked of the actor's rank once (perf.py)

    # ------------------------------------------------------------------------------------------------ the loop
    def fit(self, total_steps: int) -> list[dict]:
        history = []
        if self.cfg.trainer.val_before_train and self.p.val_source is not None and self.resumed_from is None:
            before = self.validate(announce_as="validation before training")
            if self.cfg.trainer.save_best:  # a best_metric the validation does not log is refused now, not at step N
                validation_score(before, self.cfg.trainer.best_metric)
            self.p.tracker.log(before, step=0)
        if self.step < total_steps:
            d = self.cfg.data
            progress.announce("training: steps %d-%d of %d prompts x %d response(s), up to %d tokens each; a line a "
                              "step", self.step + 1, total_steps, d.train_batch_size, self.cfg.rollout.n,
                              d.max_response_length)
        save_freq = self.cfg.trainer.save_freq
        while self.step < total_steps:
            self.step += 1
            metrics: dict = {}
            self.profile_start()
            dispatched = self.dispatch_seconds()
            with timed("step", metrics):
                with timed("gen", metrics):
                    batch = self.next_rollout()
                ahead = self.submit_ahead(total_steps, metrics)
                with timed("reward", metrics):
                    self.score(batch, metrics)
                with timed("old_log_prob", metrics):
                    self.evaluate(batch, metrics)
                with timed("adv", metrics):
                    self.compute_advantages(batch, metrics)
                if self.p.critic is not None:
                    with timed("update_critic", metrics):
                        self.update_critic(batch, metrics)
                if self.step > self.cfg.trainer.critic_warmup:
                    with timed("update_actor", metrics):
                        self.update_actor(batch, metrics)
                if ahead is not None:  # the engine answers one message at a time: the rollout before the weights
                    with timed("gen_wait", metrics):
                        self.next_batch = self.collect_ahead(ahead)
                if self.step > self.cfg.trainer.critic_warmup:
                    with timed("sync_weights", metrics):
                        self.sync_weights()
            if self.cfg.cluster.launcher == "ray":
                metrics["timing/dispatch"] = self.dispatch_seconds() - dispatched
            self.record(batch, metrics)
            self.profile_stop()
            if self.p.val_source is not None and self.cfg.trainer.test_freq > 0 and (
                    self.step % self.cfg.trainer.test_freq == 0 or self.step == total_steps):
                with profiling.phase_range("ppo/validate"):
                    metrics.update(self.validate())
            history.append(self.p.tracker.log(metrics, step=self.step))
            self.check_nonfinite(metrics)
            new_best = self.note_best(metrics)
            stop = self.stop_requested() if self.stop_requested is not None else None
            if stop or new_best or (save_freq > 0 and (self.step % save_freq == 0 or self.step == total_steps)):
                with profiling.phase_range("ppo/save"):
                    self.save_checkpoint()
            if stop:
                log.warning("%s: step %d finished and saved; stopping (resume with trainer.resume_mode=auto)", stop,
                            self.step)
                break
        return history

    # ------------------------------------------------------------------------------------------------ rollouts
    def next_rollout(self) -> RolloutBatch:
        """This step's batch: the one generated ahead during the last step (trainer.async_rollout=one_step), else
        generated now. Each row carries the policy version that generated it (``meta["weight_version"]``: actor
        updates before it) and the rollout/staleness_* metrics say how far the policy has moved since."""
        if self.next_batch is not None:
            batch, self.next_batch = self.next_batch, None
        elif self.cfg.trainer.async_rollout == "one_step":  # the first step, or max_staleness=0: nothing ahead
            pending = self.p.source.submit(self.p.sampler.next_batch(), self.step)
            batch = self.stamp(self.p.source.collect(pending), self.policy_version)
        else:
            batch = self.stamp(self.rollout(self.p.sampler.next_batch()), self.policy_version)
        return batch

    def submit_ahead(self, total_steps: int, metrics: dict):
        """one_step with max_staleness 1: the next step's prompts go to the engine now, generated with the weights
        this step starts from while this step trains; None when nothing is generated ahead."""
        t = self.cfg.trainer
        if t.async_rollout != "one_step" or t.max_staleness < 1 or self.step >= total_steps:
            return None
        with timed("gen_submit", metrics):
            return self.p.source.submit(self.p.sampler.next_batch(), self.step + 1), self.policy_version

    def collect_ahead(self, ahead) -> RolloutBatch:
        pending, version = ahead
        return self.stamp(self.p.source.collect(pending), version)

    @staticmethod
    def stamp(batch: RolloutBatch, version: int) -> RolloutBatch:
        batch.meta["weight_version"] = [version] * batch.size
        return batch

    def staleness_metrics(self, batch: RolloutBatch) -> dict:
        """Actor updates between the policy that generated each row and the one this step trains."""
        lag = np.array([self.policy_version - v for v in batch.meta["weight_version"]], dtype=np.float64)
        return {"rollout/staleness_mean": float(lag.mean()), "rollout/staleness_max": float(lag.max())}

    def dispatch_seconds(self) -> float:
        """Seconds the driver has spent so far moving calls and results to and from Ray ranks (serialisation, RPC,
        gather: each call's wall time minus its slowest rank's time in the method), over all groups."""
        return sum(group.dispatch_s for group in self.p.groups.groups.values())

    # ------------------------------------------------------------------------------------------------ checkpoints
    # ------------------------------------------------------------------------------------------------ profiling
    def profile_start(self) -> None:
        """global_profiler: this step's profiles start in the driver and, on Ray, in the chosen ranks of every role
        (with launcher=local the roles run in this process: the driver's profile holds them). Nothing is called for
        a step that is not profiled."""
        if not self.profiler.wants(self.step):
            return
        self.profiler.start(self.step)
        if self.cfg.cluster.launcher != "local":
            for role in self.enabled_roles():
                self.p.groups.get(role).call_all("profile_start", self.step)

    def profile_stop(self) -> None:
        if not self.profiler.wants(self.step):
            return
        files = list(self.profiler.stop(self.step))
        if self.cfg.cluster.launcher != "local":
            for role in self.enabled_roles():
                files += [f for rank_files in self.p.groups.get(role).call_all("profile_stop", self.step)
                          for f in rank_files or []]
        what = f"{len(files)} file(s) in {os.path.dirname(files[0])}" if files else "nsys capture range closed"
        log.info("global_profiler (%s): step %d profiled: %s", self.cfg.global_profiler.tool, self.step, what)

    def perf_metrics(self, tokens: float, response_tokens: float, timings: dict) -> dict:
        """perf/throughput, perf/rollout_tokens_per_s and perf/mfu/<role> (megatron_ppo/perf.py)."""
        if self.peak_flops is None:
            names = self.p.actor.call_all("device_name") if self.p.actor is not None else [None]
            self.peak_flops = perf.device_peak_flops(names[0], self.cfg.trainer.peak_tflops) or 0.0
        c = self.cfg.cluster
        n_devices = 1 if c.launcher == "local" else c.nnodes * c.n_gpus_per_node
        params = self.p.role_params or {}
        trained = {r: params[r] for r in self.trained_roles() if r in params}
        return perf.step_perf_metrics(
            timings, tokens, response_tokens, trained, {r: self.p.groups.get(r).layout.world_size for r in trained},
            {r: getattr(self.cfg, r).ppo_epochs for r in trained}, self.peak_flops, n_devices)

    def trained_roles(self) -> list[str]:
        return [r.name for r in roles.trained(self.cfg)]

    def enabled_roles(self) -> list[str]:
        return [r.name for r in roles.enabled(self.cfg)]

    def frozen_roles(self) -> list[str]:
        return [r.name for r in roles.enabled(self.cfg) if not r.trainable]

    def note_best(self, metrics: dict) -> bool:
        """trainer.save_best: True when this step's validation beats every earlier one (this step is then saved and
        kept as the best); the driver decides, as it decides what is global to a batch."""
        t = self.cfg.trainer
        if not t.save_best:
            return False
        score = validation_score(metrics, t.best_metric)
        if not self.best.improved_by(score):
            if score is not None and self.best.step is not None:  # (a NaN first validation: nothing to compare)
                log.info("step %d: validation %.4f, not above the best (%.4f at step %d)", self.step, score,
                         self.best.score, self.best.step)
            return False
        log.info("step %d: validation %.4f, the best so far%s: saved and kept as the best checkpoint", self.step,
                 score, "" if self.best.step is None else f" (was {self.best.score:.4f} at step {self.best.step})")
        self.best = BestValidation(self.step, score)
        return True

    def state_dict(self) -> dict:
        """The driver's own state (JSON): what the next step depends on besides the workers'."""
        return {"step": self.step, "sampler": self.p.sampler.state_dict(),
                "kl_ctrl": self.p.kl_ctrl.state_dict() if self.p.kl_ctrl is not None else None,
                "nonfinite_streak": dict(self.nonfinite_streak), "nonfinite_detail": dict(self.nonfinite_detail),
                "policy_version": self.policy_version, "best": self.best.state_dict(),
                "layouts": {role: str(self.p.groups.get(role).layout) for role in self.p.groups.groups}}

    def load_state_dict(self, state: dict) -> None:
        """Every field comes from ``state``, whatever this trainer was built with (a KL controller built with
        another init coefficient continues from the saved one)."""
        if (state["kl_ctrl"] is None) != (self.p.kl_ctrl is None):
            raise ckpt.CheckpointError(f"the checkpoint was saved {'without' if state['kl_ctrl'] is None else 'with'}"
                                       " a KL controller (algorithm.use_kl_in_reward); this run is the opposite")
        self.step = int(state["step"])
        self.p.sampler.load_state_dict(state["sampler"])
        if self.p.kl_ctrl is not None:
            self.p.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.nonfinite_streak = {k: int(v) for k, v in state["nonfinite_streak"].items()}
        self.nonfinite_detail = dict(state["nonfinite_detail"])
        self.policy_version = int(state.get("policy_version", 0))  # (absent from checkpoints before one_step)
        self.best = BestValidation.from_state(state.get("best"))

    def save_checkpoint(self) -> str:
        """Step ``self.step``'s checkpoint (see trainer/checkpoint.py for the layout), written atomically and sealed
        by its manifest; then the oldest beyond trainer.max_<role>_ckpt_to_keep are deleted. Returns the dir."""
        import time

        from megatron_ppo.parallel.rng_state import capture_rng

        t = self.cfg.trainer
        root = t.expand(t.default_local_dir)
        start = time.perf_counter()
        driver_rng = capture_rng()  # first: nothing the save does may shift the run's random streams
        tmp = ckpt.begin_save(root, self.step)
        freed = {role: sum(self.p.groups.get(role).call_all("release_heap")) for role in self.enabled_roles()}
        log.info("before the save, the ranks gave back free heap (GB): %s",
                 ", ".join(f"{role} {gb:.2f}" for role, gb in freed.items()), extra=console.FILE_ONLY)
        for role in self.trained_roles():
            states = self.p.groups.get(role).call_all("save_checkpoint", os.path.join(tmp, role))
            ckpt.write_worker_states(tmp, role, states)
        ckpt.copy_hf_config(self.cfg.model_for("actor").path, os.path.join(tmp, "actor"))
        ckpt.write_run_config(tmp, to_yaml(self.cfg))
        for role in self.frozen_roles():  # no model state to save: their RNG streams only
            ckpt.write_worker_states(tmp, role, self.p.groups.get(role).call_all("rng_state"))
        ckpt.write_driver_state(tmp, self.state_dict(), driver_rng)
        if self.next_batch is not None:  # one_step: the rollout generated ahead by the weights this step started
            ckpt.write_next_batch(tmp, self.next_batch)  # from; those weights are not saved, so neither regenerable
        final = ckpt.finish_save(root, tmp, self.step, digests=t.verify_checkpoint == "full")  # manifest last
        kept_best = () if self.best.step is None or not t.save_best else (self.best.step,)
        gone = ckpt.prune(root, {role: getattr(t, f"max_{role}_ckpt_to_keep") for role in self.trained_roles()},
                          self.step, protect=kept_best)
        if t.save_best:
            ckpt.mark_best(root, self.best.step if self.best.step is not None and os.path.isdir(
                ckpt.step_dir(root, self.best.step)) else None)
        log.info("checkpoint of step %d saved in %.1f s: %s%s", self.step, time.perf_counter() - start, final,
                 f" (deleted {len(gone)} older)" if gone else "")
        return final

    def resume(self, directory: str) -> None:
        """Load a checkpoint written by save_checkpoint (at this layout or another: the model and optimizer shards
        reshard; RNG states are restored only where the layout is the saving one)."""
        state, driver_rng = ckpt.read_driver_state(directory)
        self.load_state_dict(state)
        self.next_batch = ckpt.read_next_batch(directory)
        if self.next_batch is not None:
            log.info("%s: the rollout generated ahead for step %d (%d rows, policy v%d) is this run's next batch",
                     directory, self.step + 1, self.next_batch.size, self.next_batch.meta["weight_version"][0])
        for role in self.trained_roles():
            if not os.path.isdir(os.path.join(directory, role)):
                raise ckpt.CheckpointError(f"{directory} has no {role} model (deleted by max_{role}_ckpt_to_keep?)")
            states = ckpt.read_worker_states(directory, role)
            out = self.p.groups.get(role).call_all("load_checkpoint", os.path.join(directory, role), states)
            if not all(o["rng_restored"] for o in out):
                log.warning("%s: saved at another layout (%s); weights, optimizer and schedules restored, RNG "
                            "streams start afresh (the run continues, not bit-identically)", role,
                            state["layouts"].get(role))
        for role in self.frozen_roles():
            if os.path.isfile(ckpt.worker_state_file(directory, role)):
                self.p.groups.get(role).call_all("restore_rng_state", ckpt.read_worker_states(directory, role))
        from megatron_ppo.parallel.rng_state import restore_rng

        restore_rng(driver_rng)  # last: in-process workers share this process's generators
        self.resumed_from = directory
        log.info("resumed from %s at step %d", directory, self.step)

    # ------------------------------------------------------------------------------------------------ phases
    def rollout(self, rows: list[int]) -> RolloutBatch:
        """This step's rollouts of the sampled rows: the actor's rollout engine answers the prompts (online), or the
        stored trajectories are replayed (offline: rollout.mode, rollout/source.py)."""
        return self.p.source.batch(rows, self.step)

    def score(self, batch: RolloutBatch, metrics: dict) -> None:
        """Sequence reward placed on each response's last token: the reward model's score when
        reward.reward_model.enable (as verl: it replaces the rule), else the rule / custom function + shaping.
        Offline rows with a stored `reward` keep it (reward/stored_fraction says how many); the others are scored."""
        lengths = batch.response_lengths
        scored = score_responses(batch, self.p.tokenizer, self.p.scorer, self.p.reward, self.cfg.trainer.balance_batch)
        values, out_metrics = scored.values, scored.metrics
        stored = batch.meta.get("stored_reward")
        if stored is not None:
            values = [v if s is None else float(s) for v, s in zip(values, stored)]
            kept = np.array(values)
            metrics.update({"reward/stored_fraction": float(np.mean([s is not None for s in stored])),
                            "reward/score/mean": float(kept.mean()), "reward/score/min": float(kept.min()),
                            "reward/score/max": float(kept.max())})
        scores = torch.zeros_like(batch.response_mask)
        last = (lengths - 1).clamp(min=0)
        scores[torch.arange(batch.size), last] = torch.as_tensor(values, dtype=scores.dtype) * (lengths > 0)
        batch.tensors["token_level_scores"] = scores
        batch.tensors["sequence_scores"] = torch.as_tensor(values, dtype=torch.float32)
        metrics.update({k: v for k, v in out_metrics.items() if stored is None or not k.startswith("reward/score/")})

    def evaluate(self, batch: RolloutBatch, metrics: dict) -> None:
        """Old log-probs (actor), reference log-probs, values (critic) of the responses, forward only. With
        algorithm.rollout_correction.bypass_mode the old log-probs are the rollout's (verl's apply_bypass_mode):
        the actor's forward is skipped, and so are the metrics that compare it with the rollout."""
        payload, lengths = batch.select(keys=(), meta=False), batch.row_tokens()
        balance = self.cfg.trainer.balance_batch
        bypass = self.cfg.algorithm.rollout_correction.bypass_mode
        if bypass:
            batch.tensors["old_log_probs"] = batch.tensors["rollout_log_probs"]
        else:
            out = self.p.actor.call_rows("compute_log_probs", payload, lengths, balance=balance)
            batch.tensors["old_log_probs"] = out["log_probs"]
            metrics["actor/entropy_rollout"] = float(masked_mean(out["entropy"], batch.response_mask))
        if self.p.ref is not None:
            batch.tensors["ref_log_probs"] = self.p.ref.call_rows("compute_log_probs", payload, lengths,
                                                                      balance=balance)["log_probs"]
        if self.p.critic is not None:
            batch.tensors["values"] = self.p.critic.call_rows("compute_values", payload, lengths, balance=balance)["values"]
        if not bypass:
            diff = (batch.tensors["old_log_probs"] - batch.tensors["rollout_log_probs"]).abs()
            metrics["rollout/logprob_abs_diff_max"] = float(diff.max()) if diff.numel() else 0.0

    def compute_advantages(self, batch: RolloutBatch, metrics: dict) -> None:
        """KL-in-reward (controller) -> GAE (ops.gae) or GRPO -> whitening; rollout correction weights/masks
        (decoupled mode only: in bypass mode the actor's loss computes them from the current log-prob)."""
        t, mask, alg = batch.tensors, batch.response_mask, self.cfg.algorithm
        rewards = t["token_level_scores"]
        if alg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(rewards, t["old_log_probs"], t["ref_log_probs"], mask,
                                                   self.p.kl_ctrl, alg.kl_penalty)
            metrics.update(kl_metrics)
        t["token_level_rewards"] = rewards
        if alg.adv_estimator == "gae":
            advantages, returns = ops.gae(rewards, t["values"], mask, alg.gamma, alg.lam)
            t["advantages"], t["returns"] = masked_whiten(advantages, mask) * mask, returns
            metrics["critic/vf_explained_var"] = float(explained_variance(t["values"], returns, mask))
        else:
            index = np.array(batch.meta["uid"], dtype=object)
            t["advantages"], t["returns"] = compute_grpo_outcome_advantage(
                rewards, mask, index, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
        rc = alg.rollout_correction
        if (rc.rollout_is or rc.rollout_rs) and not rc.bypass_mode:  # bypass: inside the actor's loss, per micro-batch
            weights, new_mask, rc_metrics = compute_rollout_correction_and_rejection_mask(
                t["old_log_probs"], t["rollout_log_probs"], mask, rc.rollout_is, rc.rollout_is_threshold,
                rc.rollout_is_batch_normalize, rc.rollout_rs, rc.rollout_rs_threshold)
            if weights is not None:
                t["rollout_is_weights"] = weights
            t["loss_mask"] = new_mask  # response_mask stays: it says which tokens exist (lengths, packing)
            metrics.update(rc_metrics)
        metrics["critic/advantages/mean"] = float(masked_mean(t["advantages"], batch.loss_mask))
        metrics["critic/returns/mean"] = float(masked_mean(t["returns"], batch.loss_mask))

    def update_critic(self, batch: RolloutBatch, metrics: dict) -> None:
        self._update("critic", batch, metrics)

    def update_actor(self, batch: RolloutBatch, metrics: dict) -> None:
        if self.cfg.trainer.async_rollout == "one_step":
            metrics.update(self.staleness_metrics(batch))
        self._update("actor", batch, metrics)
        self.policy_version += 1

    def sync_weights(self) -> None:
        """The actor's rollout engine takes the updated weights (a no-op for the in-actor Megatron engine)."""
        self.p.actor.call_all("sync_weights")

    def _update(self, role: str, batch: RolloutBatch, metrics: dict) -> None:
        """The role's update on every replica's shard (the same DP split as the forwards', trainer.balance_batch)
        of the tensors its worker declares (``update_inputs``); the replicas answer the same global result (reduced
        inside the workers), so the first stands for all."""
        group = self.p.groups.get(role)
        keys = group.worker_cls.update_inputs(self.cfg, batch.tensors)
        results, _ = group.call_split("update", batch.select(keys=keys, meta=False), batch.row_tokens(), self.step,
                                      balance=self.cfg.trainer.balance_batch)
        result = results[0]
        metrics.update(result.metrics)
        self.nonfinite_streak[role] = self.nonfinite_streak.get(role, 0) + 1 if result.nonfinite_skips else 0
        if result.nonfinite_skips:
            self.nonfinite_detail[role] = result.nonfinite_detail()

    def check_nonfinite(self, metrics: dict) -> None:
        """Stop after trainer.max_consecutive_skips steps in a row in which a role had any update skipped for a
        non-finite loss or gradient norm (-1: never stop). The skipped updates never touched the weights; the
        step's metrics are already logged."""
        limit = self.cfg.trainer.max_consecutive_skips
        stuck = [role for role, streak in self.nonfinite_streak.items() if limit != -1 and streak >= limit]
        if stuck:
            raise NonFiniteTrainingError("; ".join(
                f"{role}: {self.nonfinite_streak[role]} consecutive steps (the last: step {self.step}) had {role} "
                f"updates skipped for a non-finite loss or gradient norm: {self.nonfinite_detail[role]}"
                for role in stuck) + f" (trainer.max_consecutive_skips={limit}). reward/score range at step "
                f"{self.step}: [{metrics.get('reward/score/min')}, {metrics.get('reward/score/max')}]. The weights "
                "hold the last finite update; look at the reward scale, the learning rate and the loss settings.")

    def record(self, batch: RolloutBatch, metrics: dict) -> None:
        lengths = batch.response_lengths.float()
        tokens = batch.num_tokens(range(batch.size))
        metrics.update({
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float((lengths >= batch.responses.shape[1]).float().mean()),
            "perf/total_num_tokens": float(tokens),
            "perf/tokens_per_s": tokens / max(metrics.get("timing/step", 0.0), 1e-9),
        })
        metrics.update(self.perf_metrics(float(tokens), float(lengths.sum()), metrics))
        if "stopped" in batch.meta:  # rollout.stop_pattern on: the share of responses it ended
            metrics["response_length/stop_ratio"] = float(np.mean(batch.meta["stopped"]))
        if self.p.kl_ctrl is not None:
            metrics["actor/kl_coef"] = float(self.p.kl_ctrl.value)
        if self.p.dumper is not None:
            self.p.dumper(self.step, batch)

    def validate(self, announce_as: str | None = None) -> dict:
        """val_kwargs generation (n responses per prompt) on the validation prompts; mean reward per data source.
        announce_as: a name, to log a start line, a line a batch and the duration (before training: minutes of silence
        with a real model otherwise)."""
        source = self.p.val_source
        size = self.cfg.data.val_batch_size or len(source)
        scores, sources = [], []
        val = self.cfg.rollout.val_kwargs
        greedy = not val.do_sample or val.temperature == 0
        bar = None if announce_as is None else BatchProgress(
            announce_as, len(source), size, detail=f"{'greedy' if greedy else 'sampled'}, n={val.n}, up to "
            f"{self.cfg.data.max_response_length} tokens")
        for rows in chunk_rows(list(range(len(source))), size):
            batch = source.batch(rows, self.step)
            if bar is not None:
                bar.advance(len(rows))
            self.score(batch, {})
            scores += batch.tensors["sequence_scores"].tolist()
            sources += batch.meta["data_source"]
        return {f"val/test_score/{src}": float(np.mean([s for s, d in zip(scores, sources) if d == src]))
                for src in sorted(set(sources))}
