"""`megatron-ppo train [--config NAME|PATH] [key=value ...]`: PPO from a YAML config.

This is the in-process driver on one rank (TP = PP = DP = 1). Multi-rank runs go through the Ray driver, the next
roadmap item; a config asking for more ranks is refused here rather than silently run on one.
"""
from __future__ import annotations

import argparse
import logging
import math

from megatron_ppo.config import load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ppo train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny_cpu", help="config name in configs/ or a YAML path (default: tiny_cpu)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.clip_ratio=0.3 trainer.total_training_steps=8")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    ranks = {role: p.tensor_model_parallel_size * p.pipeline_model_parallel_size
             for role, p in vars(cfg.cluster).items() if hasattr(p, "tensor_model_parallel_size")}
    if cfg.cluster.world_size != 1 or any(n != 1 for n in ranks.values()):
        raise SystemExit(f"megatron-ppo train: the in-process driver runs on one rank; this config asks for "
                         f"cluster.nnodes x n_gpus_per_node = {cfg.cluster.world_size} and model-parallel sizes "
                         f"{ranks}. Multi-rank training needs the Ray driver (not built yet).")
    if cfg.rollout.mode != "online":
        raise SystemExit("megatron-ppo train: rollout.mode=offline needs the Ray driver (not built yet); the "
                         "trajectory dataset and rollout correction it uses are in megatron_ppo.data / algo")

    from megatron_ppo import parallel
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import PPOTrainer

    parallel.initialize(tp=1, pp=1, seed=cfg.trainer.seed)
    try:
        parts = build_components(cfg)
        history = PPOTrainer(cfg, parts).fit(parts.total_steps)
        parts.tracker.close()
    finally:
        parallel.destroy()
    last = history[-1] if history else {}
    score = last.get("reward/score/mean", math.nan)
    print(f"megatron-ppo train: {len(history)} steps done; last reward/score/mean={score:.4f}")
    return 0
