"""The error type the command line turns into exit code 2. Imports nothing from the package (any module may use it)."""
from __future__ import annotations


class UsageError(ValueError):
    """What the user fixes by changing a key, a file or an argument: the CLI exits 2.

    Every input error of the package (ConfigError, SchemaError, PreflightError, LayoutError, ...) subclasses it, so
    `console.report_error` picks the exit code by type: one line, "megatron-ppo <command>: error: <message>"."""

    exit_code = 2
