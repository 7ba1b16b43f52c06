"""The in-actor rollout engine: the actor's own Megatron model shard generates (rollout/generation.py: a KV-cached
decode loop; rollout/decode_step.py: the lean one-token step; models/attention.py: the cached RoPE attention).

It shares the actor's weights, so ``sync_weights`` has nothing to copy. Its settings are rollout.megatron.*; the
worker adds its own GEMM decision (cpu_gemm), which covers its rollouts too.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_ppo.rollout.base import GenerationOutput, SamplingParams
from megatron_ppo.rollout.generation import DecodeOptions, generate


def decode_options(engine_cfg, *, onednn: bool, cpu_gemm: str) -> DecodeOptions:
    """rollout.megatron.* plus the worker's GEMM choice: the prefill forwards follow the worker's oneDNN decision
    (so cpu_gemm=auto keeps a small model's prefill on torch's GEMMs); cpu_gemm=torch also turns off the decode
    step's prepacked weights."""
    graphs = engine_cfg.cuda_graphs
    return DecodeOptions(prefill=engine_cfg.prefill, drop_finished=engine_cfg.drop_finished,
                         compile_decode=engine_cfg.use_torch_compile, onednn_prefill=onednn,
                         packed_linears=cpu_gemm != "torch",
                         cuda_graphs=graphs if isinstance(graphs, str) else str(graphs).lower(),
                         batch_buckets=tuple(engine_cfg.batch_buckets),
                         alive_check_interval=engine_cfg.alive_check_interval,
                         prefill_token_budget=engine_cfg.prefill_token_budget,
                         max_num_seqs=engine_cfg.max_num_seqs)


class MegatronEngine:
    """``RolloutEngine`` over the model the actor trains (``module()``: the DDP wrapper or the bare model)."""

    def __init__(self, module: Callable[[], torch.nn.Module], options: DecodeOptions):
        self.module = module
        self.options = options

    @classmethod
    def for_worker(cls, worker, engine_cfg=None) -> "MegatronEngine":
        """The engine over a MegatronWorker's model (``engine_cfg``: rollout.megatron, default its defaults)."""
        if engine_cfg is None:
            from megatron_ppo.config.schema import MegatronRolloutConfig

            engine_cfg = MegatronRolloutConfig()
        return cls(lambda: worker.module, decode_options(engine_cfg, onednn=worker.onednn, cpu_gemm=worker.cpu_gemm))

    def generate(self, prompt_ids: Sequence[torch.Tensor], params: SamplingParams) -> GenerationOutput:
        return generate(self.module(), list(prompt_ids), params, self.options)

    def sync_weights(self) -> None:
        """Nothing to do: generation runs on the weights the update just changed."""


def build_engine(worker, cfg) -> MegatronEngine:
    """The engine of an actor rank: its own model (``worker.module``) and rollout.megatron.*."""
    return MegatronEngine.for_worker(worker, cfg.rollout.megatron)
