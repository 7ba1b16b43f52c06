"""`megatron-ppo train [--config NAME|PATH] [key=value ...]`: PPO from a YAML config.

The driver runs in this process; the models run in worker groups: Ray actors per rank (cluster.launcher=ray, the
default) or one in-process rank per role (cluster.launcher=local). A layout the cluster cannot host, and a damaged
checkpoint to resume from (trainer/checkpoint.py: find_resume), are refused before any process starts; a rank
that fails or dies ends the run with a non-zero exit naming role, rank and node, and every rank, placement group
and Ray cluster started here is gone before the process exits.
"""
from __future__ import annotations

import argparse
import math
import sys

from megatron_ppo.config import load_config
from megatron_ppo.errors import UsageError  # refusals before anything runs: exit 2 (cli -> console.report_error)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ppo train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny_cpu", help="config name in configs/ or a YAML path (default: tiny_cpu)")
    p.add_argument("--dry-run", action="store_true", help="check config, data, rewards, outputs and models (seconds, "
                   "nothing built) and print the resolved plan")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.clip_ratio=0.3 trainer.total_training_steps=8")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megatron_ppo import console
    from megatron_ppo.config.checks import unsupported_settings
    from megatron_ppo.trainer.preflight import describe_plan, run_preflight

    console.setup_logging()
    cfg = load_config(args.config, args.overrides)
    refused = unsupported_settings(cfg)
    if refused:
        raise UsageError(f"the driver does not support {refused}. Nothing was run.")
    # inputs, outputs, loggers, models, then cluster.device and the layout arithmetic: in seconds, before any
    # process starts; "preflight ok" is logged only when every check passed (--dry-run runs the same checks)
    checked = run_preflight(cfg)
    if args.dry_run:
        print(describe_plan(cfg, checked))
        return 0
    from megatron_ppo.config import to_yaml
    from megatron_ppo.trainer.checkpoint import CheckpointError, find_resume, resume_step
    from megatron_ppo.trainer.tracking import LogDirInUseError, claim_log_dir

    try:  # trainer.resume_mode: which checkpoint (if any) this run continues, checked against its manifest
        resume = find_resume(cfg.trainer)  # (sizes: milliseconds); damaged: auto falls back, resume_path exits 2
    except CheckpointError as exc:
        raise UsageError(f"{exc}. Nothing was run.") from exc
    try:  # before anything is built: a second run into the same log dir is refused in a second, not after minutes
        claim_log_dir(cfg.trainer, to_yaml(cfg), resume_step(resume) if resume else None)
    except LogDirInUseError as exc:
        raise UsageError(f"{exc}. Nothing was run.") from exc
    console.set_run_log(f"{cfg.trainer.expand(cfg.trainer.log_dir)}/train.log")

    from megatron_ppo.distributed import WorkerGroupError
    from megatron_ppo.distributed.group import EXIT_NODE_LOST, NodeLostError
    from megatron_ppo.trainer.components import build_components
    from megatron_ppo.trainer.ppo import NonFiniteTrainingError, PPOTrainer
    from megatron_ppo.trainer.preemption import Preemption

    parts = None
    preemption = Preemption().install()  # SIGTERM/SIGUSR1: finish the step, save, exit 0; SIGINT: exit 130 now
    try:
        parts = build_components(cfg, resuming=resume is not None)
        preemption.install()  # again: ray.init replaced the SIGTERM handler with Ray's (which aborts)
        parts.tracker.total_steps = parts.total_steps  # the console line's "step i/N" and ETA
        trainer = PPOTrainer(cfg, parts)
        if resume:
            trainer.resume(resume)
        trainer.stop_requested = preemption.requested
        history = trainer.fit(parts.total_steps)
    except NonFiniteTrainingError as exc:
        raise SystemExit(f"megatron-ppo train: stopped: {exc}") from None
    except WorkerGroupError as exc:
        print(f"megatron-ppo train: a worker failed:\n{exc}", file=sys.stderr, flush=True)
        print(f"megatron-ppo train: stopped: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_NODE_LOST if isinstance(exc, NodeLostError) else 1) from None
    finally:
        if parts is not None:
            parts.close()
        preemption.uninstall()
    if preemption.requested():
        print(f"megatron-ppo train: stopped by {preemption.requested()} after step {trainer.step}; checkpoint in "
              f"{cfg.trainer.expand(cfg.trainer.default_local_dir)}/global_step_{trainer.step} (rerun the same "
              "command with trainer.resume_mode=auto to continue)")
    last = history[-1] if history else {}
    score = last.get("reward/score/mean", math.nan)
    logs = cfg.trainer.expand(cfg.trainer.log_dir)
    print(f"megatron-ppo train: {len(history)} step{'' if len(history) == 1 else 's'} done; last "
          f"reward/score/mean={score:.4f}")
    print(console.written_paths(cfg, logs))
    return 0
