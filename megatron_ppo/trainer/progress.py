"""The per-step console output of `megatron-ppo train`: a rich progress bar on a terminal, one line per step elsewhere.

On a terminal the bar (step i/N, ETA, reward, KL, step time) stays at the bottom while each step's summary line
(console.step_line) scrolls above it, together with Ray's worker output and our log records. Where stdout is a
file or a pipe (CI, Slurm, `| tee`) a live bar cannot redraw: rich prints its final frame only when it stops (or,
forced, writes cursor-movement codes into the log), so there each step prints its summary line and nothing else,
which is what `grep`/`tail -f` want. The choice is `stream.isatty()` (and TERM != dumb), not rich's own detection,
which FORCE_COLOR in a CI environment turns to "terminal".
"""
from __future__ import annotations

import logging
import os
import sys

from megatron_ppo import console

BAR_FIELDS = ("reward", "kl", "time", "eta")  # after "step i/N": what the bar shows (the words)


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
