"""Metric sinks: console, jsonl, tensorboard, wandb, swanlab — one `log(metrics, step)` call fans out to all.

Metric names follow verl (`actor/pg_loss`, `critic/vf_explained_var`, `timing/<phase>`, ...), so dashboards built
for verl read ours unchanged.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "swanlab")


def _as_float(value) -> float:
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class Tracker:
    """Fans a dict of scalar metrics out to the configured loggers."""

    def __init__(self, loggers: list[str], log_dir: str, project: str = "megatron_ppo", experiment: str = "run",
                 config: Mapping | None = None):
        unknown = [name for name in loggers if name not in KNOWN_LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; allowed: {list(KNOWN_LOGGERS)}")
        self.loggers = list(loggers)
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a") if "jsonl" in loggers else None
        self._tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package (extra: tracking)

            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
        self._wandb = None
        if "wandb" in loggers:
            import wandb

            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}), dir=log_dir)
        self._swanlab = None
        if "swanlab" in loggers:
            import swanlab

            self._swanlab = swanlab.init(project=project, experiment_name=experiment, config=dict(config or {}))

    def log(self, metrics: Mapping, step: int) -> dict[str, float]:
        scalars = {key: _as_float(value) for key, value in metrics.items()}
        if "console" in self.loggers:
            shown = " ".join(f"{key}={value:.4g}" for key, value in sorted(scalars.items()))
            print(f"step {step}: {shown}", flush=True)
        if self._jsonl is not None:
            record = {key: (value if math.isfinite(value) else str(value)) for key, value in scalars.items()}
            self._jsonl.write(json.dumps({"step": step, **record}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._swanlab is not None:
            self._swanlab.log(scalars, step=step)
        return scalars

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


@contextlib.contextmanager
def timed(name: str, metrics: dict) -> Iterator[None]:
    """Record the wall time of a phase as `timing/<name>` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"timing/{name}"] = time.perf_counter() - start
