"""Metric sinks: console, jsonl, tensorboard, wandb, swanlab — one `log(metrics, step)` call fans out to all.

The console gets a short line per step and, on a terminal, a progress bar (trainer/progress.py).

With the jsonl logger the log dir also gets PNG curves (trainer/plots.py: DIR/curves.png, DIR/curves/*.png),
redrawn after every record with validation metrics and at close; GPU utilisation and memory (perf/gpu_util,
perf/gpu_mem_gib, trainer/run_record.GpuMonitor) join every record when NVML sees a GPU.

Metric names follow verl (`actor/pg_loss`, `critic/vf_explained_var`, `timing/<phase>`, ...), so dashboards built
for verl read ours unchanged.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping

from megatron_ppo.errors import UsageError

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "swanlab")
METRICS_FILE = "metrics.jsonl"  # one {"step": N, ...} record per line, nothing else (readers rely on that)
RUN_FILE = "run.json"  # beside it: which run wrote the records


class LogDirInUseError(UsageError, FileExistsError):
    """The log dir's metrics.jsonl already holds another run's records; appending would mix two runs."""


def _records_in(path: str) -> int:
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _last_step_in(path: str) -> int:
    """The highest training step recorded in metrics.jsonl: 0 when there is none (no file, empty, or only the
    validation before training, logged at step 0); a line that is not a record counts as a step (kept, not lost)."""
    last = 0
    if os.path.isfile(path):
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    step = json.loads(line)["step"]
                    last = max(last, step if isinstance(step, int) else 1)
                except (ValueError, KeyError, TypeError):
                    last = max(last, 1)
    return last


def claim_log_dir(trainer_cfg, config_text: str, resume_step: int | None = None) -> str:
    """Make trainer.log_dir this run's, before anything expensive is built; returns the expanded directory.

    A metrics.jsonl with training steps of an earlier run is refused (records of two runs in one file cannot be
    told apart) unless trainer.overwrite, which empties it. An earlier run that never logged a training step (it
    failed, or was stopped or killed, before step 1: an empty file, or only its validation at step 0) does not
    block: its file is started afresh, as the rerun logs that validation again. Accepted here rather than cleaned
    up on the way out, because a start that is killed (SIGKILL, the OOM killer, a lost node) runs no clean-up;
    run.json and train.log stay until the rerun replaces or appends to them (train.log holds the error). Then
    run.json names this run: start time and the sha256 of its resolved config. Resuming from a checkpoint of step
    ``resume_step`` is the one case where the earlier records stay: those after that step are dropped (the resumed
    run writes them again), so the file holds each step once, and the run appends (Tracker(append=True)).
    """
    t = trainer_cfg
    log_dir = t.expand(t.log_dir)
    if "jsonl" not in t.logger:
        return log_dir
    metrics = os.path.join(log_dir, METRICS_FILE)
    records = _records_in(metrics)
    last_step = _last_step_in(metrics) if records else 0
    if resume_step is not None:
        os.makedirs(log_dir, exist_ok=True)
        _truncate_after(metrics, resume_step)
    elif last_step and not t.overwrite:
        elsewhere = ("a new trainer.experiment_name" if "{experiment_name}" in t.log_dir
                     else "another trainer.log_dir")
        raise LogDirInUseError(
            f"trainer.log_dir={log_dir}: {metrics} already holds {records} records of an earlier run (up to step "
            f"{last_step}; {_describe_run(os.path.join(log_dir, RUN_FILE))}); a second run would be mixed into the "
            f"same file. Set trainer.overwrite=true to start it afresh, or choose {elsewhere}")
    else:
        if records and not t.overwrite:
            logging.getLogger(__name__).info(
                "trainer.log_dir=%s: the earlier run there logged no training step (%d validation record(s) at "
                "step 0); starting %s afresh", log_dir, records, METRICS_FILE)
        os.makedirs(log_dir, exist_ok=True)
        open(metrics, "w").close()  # empty: this run's records only (overwrite, or no training step yet)
    run = {"run_start": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
           "project_name": t.project_name, "experiment_name": t.experiment_name, "metrics": METRICS_FILE}
    if resume_step is not None:
        run["resumed_from_step"] = resume_step
    tmp = os.path.join(log_dir, f".{RUN_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(run, f, indent=1)
    os.replace(tmp, os.path.join(log_dir, RUN_FILE))
    return log_dir


def _truncate_after(metrics: str, step: int) -> None:
    """Keep the records of steps <= ``step`` (atomically: a crash here leaves the old file)."""
    kept = []
    if os.path.isfile(metrics):
        with open(metrics) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record_step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{metrics} line {n}: not a metrics record ({exc}); cannot resume into it")
                if record_step <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    tmp = metrics + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, metrics)


def _describe_run(run_file: str) -> str:
    try:
        with open(run_file) as f:
            run = json.load(f)
        return f"started {run['run_start']}, config sha256 {run['config_sha256'][:12]}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {RUN_FILE}"


def _as_float(value) -> float:
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


class Tracker:
    """Fans a dict of scalar metrics out to the configured loggers."""

    def __init__(self, loggers: list[str], log_dir: str, project: str = "megatron_ppo", experiment: str = "run",
                 config: Mapping | None = None, overwrite: bool = False, append: bool = False):
        """A metrics.jsonl that already has records is refused (LogDirInUseError) unless `overwrite`, which
        starts it afresh: one file never holds two runs. `append`: a resumed run continues the file (which
        claim_log_dir has cut back to the resumed step)."""
        unknown = [name for name in loggers if name not in KNOWN_LOGGERS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {unknown}; allowed: {list(KNOWN_LOGGERS)}")
        self.loggers = list(loggers)
        self.log_dir = log_dir
        from megatron_ppo.trainer.run_record import GpuMonitor

        self.gpu = GpuMonitor()
        self.curves: list[str] = []  # the PNGs written last
        self.total_steps: int | None = None  # set by the driver: the console's "step i/N", ETA and progress bar
        self._progress = None
        os.makedirs(log_dir, exist_ok=True)
        self._jsonl = None
        if "jsonl" in loggers:
            path = os.path.join(log_dir, METRICS_FILE)
            records = 0 if overwrite or append else _records_in(path)
            if records:
                raise LogDirInUseError(f"{path} already holds {records} records of an earlier run; pass "
                                       "overwrite=True (trainer.overwrite=true) or use another log dir")
            self._jsonl = open(path, "a" if append else "w")
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
        scalars = {key: _as_float(value) for key, value in {**metrics, **self.gpu.sample()}.items()}
        if "console" in self.loggers:  # the key metrics, ETA and (on a terminal) a bar; every metric with --verbose
            from megatron_ppo import console
            from megatron_ppo.trainer.progress import StepProgress

            if self._progress is None:
                self._progress = StepProgress(self.total_steps)
            self._progress.show(step, scalars, verbose=console.verbose_enabled())
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
        if any(key.startswith("val/") for key in scalars):
            self.plot()
        return scalars

    def plot(self) -> list[str]:
        """Redraw the PNG curves from metrics.jsonl (jsonl logger only). A plotting failure is logged, never
        raised: the curves are a view of the run, not part of it."""
        if self._jsonl is None:
            return []
        from megatron_ppo.trainer.plots import plot_run

        try:
            self.curves = [str(p) for p in plot_run(self.log_dir)]
        except Exception as e:  # noqa: BLE001
            logging.getLogger(__name__).warning("plotting the curves of %s failed: %s", self.log_dir, e)
        return self.curves

    def close(self) -> None:
        if self._progress is not None:  # first: the bar gives the terminal back before anything else prints
            self._progress.close()
            self._progress = None
        if self._jsonl is not None:
            self._jsonl.close()
            if self.plot():
                print(f"curves: {self.curves[0]} (one PNG per panel in {os.path.join(self.log_dir, 'curves')}); "
                      f"run record: config.yaml, versions.json, layout.json in {self.log_dir}", flush=True)
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


@contextlib.contextmanager
def timed(name: str, metrics: dict) -> Iterator[None]:
    """Record the wall time of a phase as `timing/<name>` (seconds), inside the range `ppo/<name>` (torch traces,
    Nsight Systems' NVTX: megatron_ppo/profiling.py)."""
    from megatron_ppo.profiling import phase_range

    start = time.perf_counter()
    try:
        with phase_range(f"ppo/{name}"):
            yield
    finally:
        metrics[f"timing/{name}"] = time.perf_counter() - start
