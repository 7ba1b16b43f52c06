"""The per-step console output of `megatron-ppo train`: a rich progress bar on a terminal, one line per step elsewhere.

On a terminal the bar (step i/N, ETA, reward, KL, step time) stays at the bottom while each step's summary line
(console.step_line) scrolls above it, together with Ray's worker output and our log records. Where stdout is a
file or a pipe (CI, Slurm, `| tee`) a live bar cannot redraw: rich prints its final frame only when it stops (or,
forced, writes cursor-movement codes into the log), so there each step prints its summary line and nothing else,
which is what `grep`/`tail -f` want. The choice is `stream.isatty()` (and TERM != dumb), not rich's own detection,
which FORCE_COLOR in a CI environment turns to "terminal".

Before step 1 (``announce``, ``BatchProgress``): one log line as each start-up phase begins (data, building the
roles, validation before training with a line per batch and its duration, training). With a real model these phases
take minutes (SmolLM2 on 2 cores: ~7 min for the first validation alone), and a silent console reads as a hang.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from megatron_ppo import console

BAR_FIELDS = ("reward", "kl", "time", "eta")  # after "step i/N": what the bar shows (the words)

log = logging.getLogger(__name__)


def duration(seconds: float) -> str:
    """'4.2 s' under a minute, else 'm:ss' or 'h:mm:ss'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def announce(message: str, *args) -> None:
    """A start-up phase begins: one line on the console (and in train.log)."""
    log.info(message, *args)


class BatchProgress:
    """A long loop over batches before training: a start line, '<what>: i/N <unit>, <elapsed>' after each batch
    but the last, and '<what>: N <unit> in <duration>' at the end."""

    def __init__(self, what: str, total: int, batch: int, unit: str = "prompts", detail: str = "",
                 clock=time.monotonic):
        self.what, self.total, self.unit, self.done_count = what, total, unit, 0
        self.clock = clock  # a seam for tests: patching time.monotonic itself reaches pytest's own hooks
        self.start = clock()
        batches = max(1, -(-total // max(batch, 1)))
        log.info("%s: %d %s in %d batch%s of %d%s ...", what, total, unit, batches, "" if batches == 1 else "es",
                 min(batch, total), f" ({detail})" if detail else "")

    def advance(self, n: int) -> None:
        self.done_count += n
        elapsed = duration(self.clock() - self.start)
        if self.done_count < self.total:
            log.info("%s: %d/%d %s, %s", self.what, self.done_count, self.total, self.unit, elapsed)
        else:
            log.info("%s: %d %s in %s", self.what, self.total, self.unit, elapsed)


def is_terminal(stream) -> bool:
    """True when `stream` is an interactive terminal a live bar can redraw."""
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class StepProgress:
    """`show(step, scalars)` once per logged step; `close()` at the end (restores the terminal)."""

    def __init__(self, total_steps: int | None, stream=None, terminal: bool | None = None):
        self.total_steps = total_steps
        self.stream = sys.stdout if stream is None else stream
        self.terminal = is_terminal(self.stream) if terminal is None else terminal
        self._progress = None
        self._task = None
        self._handlers: list[tuple[logging.StreamHandler, object]] = []

    def show(self, step: int, scalars: dict, verbose: bool = False) -> str:
        """Print the step's line (every metric when verbose) and, on a terminal, move the bar; returns the line."""
        parts = console.step_parts(step, scalars, self.total_steps)
        line = (f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in sorted(scalars.items()))) if verbose \
            else "  ".join(parts.values())
        if not (self.terminal and self.total_steps and step > 0):  # validation before training is not a step
            if self._progress is not None:
                self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                print(line, file=self.stream, flush=True)
            return line
        starting = self._progress is None
        if starting:
            self._create()
        self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        self._progress.update(self._task, completed=step, description=parts["step"],
                              summary="  ".join(parts[k] for k in BAR_FIELDS if k in parts))
        if starting:  # after the first update: no empty frame
            self._start()
        return line

    def _create(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[summary]}"),
                                  console=Console(file=self.stream, force_terminal=True), transient=False)
        self._task = self._progress.add_task("", total=self.total_steps, summary="")

    def _start(self) -> None:
        from rich.file_proxy import FileProxy

        self._progress.start()
        if not isinstance(sys.stderr, FileProxy):
            return
        # our log records (and those of libraries) go through rich's proxy above the bar too, instead of into it
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.__stderr__, sys.__stdout__):
                self._handlers.append((handler, handler.stream))
                handler.setStream(sys.stderr)

    def close(self) -> None:
        if self._progress is None:
            return
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers.clear()
        self._progress.stop()
        self._progress = None
