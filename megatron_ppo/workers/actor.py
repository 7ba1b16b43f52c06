"""ActorWorker: rollout generation (through its rollout engine), old log-probs, and the PPO policy update, on one
rank of the actor's layout.

The driver sends data and the step number; the loss is built here from cfg.actor (workers/losses.actor_loss_fn),
and the target-KL guard lives here, deciding per mini-batch on the KL reduced over the pipeline and DP groups
(identical on every rank; its counters too). The rollout engine is ``rollout.name`` (megatron_ppo/rollout/).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_ppo import parallel
from megatron_ppo.algo.kl_control import TargetKLGuard
from megatron_ppo.data.batch import RolloutBatch
from megatron_ppo.parallel.transfer import to_host
from megatron_ppo.rollout import SamplingParams, build_engine, replica_seed
from megatron_ppo.workers.losses import actor_loss_fn, logprob_output_fn
from megatron_ppo.workers.role import RoleWorker
from megatron_ppo.workers.update import UpdateResult


class ActorWorker(RoleWorker):
    ROLE = "actor"

    def __init__(self, cfg, vocab_size: int, total_steps: int = 1):
        super().__init__(cfg, vocab_size, total_steps)
        g = cfg.algorithm.kl_guard
        self.guard = TargetKLGuard(g.target_kl) if g.enable else None
        self.weights_version = 0  # grows whenever the weights change (update, load): an engine with its own copy
        # of the weights must hold this version to generate (rollout/vllm.py)
        self.engine = build_engine(cfg.rollout.name, self, cfg)
        self.submitted = None  # the SamplingParams of a rollout in flight (generate_submit)

    def generate(self, prompts: dict, params: SamplingParams, step: int) -> dict:
        """Responses to this replica's prompts ({"prompt_ids": [...]}), padded to max_response_length; each DP
        replica samples with its own seed (rollout.base.replica_seed: trainer.seed, step, replica)."""
        params = self._replica_params(params, step)
        self.current_params()
        return self._padded(self.engine.generate(list(prompts["prompt_ids"]), params), params)

    def generate_submit(self, prompts: dict, params: SamplingParams, step: int) -> None:
        """``generate``, started and left running (trainer.async_rollout=one_step): the engine generates with the
        weights held now while this rank goes on training; ``generate_collect`` takes the answer. Engines that
        generate inside this rank have no submit (config/checks.py refuses them)."""
        params = self._replica_params(params, step)
        self.current_params()
        self.engine.submit(list(prompts["prompt_ids"]), params)
        self.submitted = params

    def generate_collect(self) -> dict | None:
        """The submitted rollout, as ``generate`` answers."""
        if self.submitted is None:
            raise RuntimeError("generate_collect: no rollout was submitted")
        params, self.submitted = self.submitted, None
        return self._padded(self.engine.collect(), params)

    def _replica_params(self, params: SamplingParams, step: int) -> SamplingParams:
        seed = replica_seed(self.cfg.trainer.seed, step, parallel.dp_size(), parallel.dp_rank())
        return dataclasses.replace(params, seed=seed)

    @staticmethod
    def _padded(out, params: SamplingParams) -> dict | None:
        if out is None:  # an engine answering on the replica's representative rank only (vLLM)
            return None
        pad = params.max_response_length - out.responses.shape[1]
        responses = torch.nn.functional.pad(out.responses, (0, pad), value=params.pad_token_id)
        log_probs = torch.nn.functional.pad(out.log_probs, (0, pad), value=0.0)
        return to_host({"responses": responses, "response_lengths": out.response_lengths, "log_probs": log_probs})

    def sync_weights(self) -> None:
        """After an update: the engine takes the new weights (a no-op for the in-actor engine)."""
        self.current_params()
        self.engine.sync_weights()

    def close(self) -> None:
        """End what the engine runs besides this rank (the vLLM process); the group calls it on shutdown."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def compute_log_probs(self, batch: RolloutBatch) -> dict | None:
        """{"log_probs", "entropy"} [B, R] of the responses under the current policy (rollout temperature)."""
        r = self.cfg.rollout
        return self.forward_rows(batch, r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz,
                                 r.log_prob_max_token_len_per_gpu, logprob_output_fn(self.vocab_size, r.temperature))

    @classmethod
    def update_inputs(cls, cfg, available) -> tuple[str, ...]:
        return ("old_log_probs", "advantages") + (("ref_log_probs",) if cfg.actor.use_kl_loss else ()) + (
            ("rollout_is_weights",) if "rollout_is_weights" in available else ())

    def make_loss(self, mini_batch_tokens: int, mini_batch_seqs: int):
        return actor_loss_fn(self.cfg.actor, vocab_size=self.vocab_size, temperature=self.cfg.rollout.temperature,
                             mini_batch_tokens=mini_batch_tokens, mini_batch_seqs=mini_batch_seqs,
                             rollout_correction=self.cfg.algorithm.rollout_correction)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.weights_version += 1

    def load_checkpoint(self, directory: str, rank_states: list[dict]) -> dict:
        out = super().load_checkpoint(directory, rank_states)
        self.weights_version += 1
        return out

    def load_weights(self, directory: str) -> dict:
        out = super().load_weights(directory)
        self.weights_version += 1
        return out

    def update(self, batch: RolloutBatch, step: int) -> UpdateResult:
        self.weights_version += 1
        result = super().update(batch, step)
        if self.guard is not None:
            result.metrics.update(self.guard.step_metrics())
        return result

    def guard_state(self) -> dict | None:
        return None if self.guard is None else self.guard.state_dict()
