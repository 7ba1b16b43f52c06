"""Preemption for the driver process: SIGTERM / SIGUSR1 (what Slurm sends before a time limit) ask the run to finish
its current step, save a checkpoint and exit 0; a second such signal exits at once (128 + the signal's number);
SIGINT (Ctrl-C) exits at once with 130, one line and no traceback.

The handler only sets a flag (a Python signal handler runs between bytecodes of the main thread); the fit loop
reads it after each step (PPOTrainer.stop_requested).
"""
from __future__ import annotations

import signal
import sys

GRACEFUL = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def install(self) -> "Preemption":
        """Set the handlers; call again after ray.init, which installs Ray's C++ failure-signal handler for SIGTERM
        over ours (it would abort the driver). The handlers to restore stay the first call's."""
        for sig in GRACEFUL + (signal.SIGINT,):
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested(self) -> str | None:
        """The name of the signal that asked the run to stop, or None."""
        return self.signal_name

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        name = signal.Signals(signum).name
        if signum == signal.SIGINT or self.signal_name is not None:
            print(f"megatron-ppo train: {name}{' again' if self.signal_name else ''}: exiting now, without "
                  "saving", file=sys.stderr, flush=True)
            raise SystemExit(130 if signum == signal.SIGINT else 128 + signum)
        self.signal_name = name
        print(f"megatron-ppo train: {name}: finishing the current step, then saving a checkpoint and exiting "
              "(send it again to exit at once)", file=sys.stderr, flush=True)
