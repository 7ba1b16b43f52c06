"""`megatron-ppo [--debug] [--verbose] <command> [args]`: one entry point, each command owned by the module that
implements it.

Commands are imported lazily so that `megatron-ppo preprocess` does not pay for importing Megatron or Ray.
Each command module exposes `main(argv: list[str]) -> int`. Errors reach the user as one line (console.report_error):
exit 2 for usage, config and data errors (a UsageError, megatron_ppo/errors.py, carries exit code 2: every input error
class subclasses it), 130/143 when interrupted by SIGINT/SIGTERM, 1 for anything else (a SystemExit("message") too);
the traceback goes to the run's log file, and to the screen with --debug (or MEGATRON_PPO_DEBUG=1).
"""
from __future__ import annotations

import importlib
import os
import sys

from megatron_ppo import __version__

COMMANDS = {
    "train": ("megatron_ppo.trainer.entry", "run PPO from a YAML config (default: configs/tiny_cpu.yaml)"),
    "preprocess": ("megatron_ppo.data.preprocess", "verl-schema parquet: gsm8k (from its jsonl), arithmetic "
                   "(generated); tokenizer (a small BPE from GSM8K text)"),
    "convert": ("megatron_ppo.convert.cli", "checkpoint conversion: hf-to-mcore, mcore-to-hf (TP/PP resharding), "
                "gguf-to-hf, verify (HF vs Megatron logits)"),
    "eval": ("megatron_ppo.evaluation.cli", "held-out accuracy of an HF model or a checkpoint (same scoring as "
             "validation)"),
    "plot": ("megatron_ppo.trainer.plots", "PNG curves of a run from its metrics.jsonl (megatron-ppo plot DIR)"),
    "plan": ("megatron_ppo.plan.cli", "per-GPU memory, feasible TP/PP/DP layouts and step time of a config"),
    "checkpoint": ("megatron_ppo.trainer.checkpoint_manifest", "check a run's checkpoints against their manifests "
                   "(checkpoint verify DIR [--full])"),
}
# flags valid before or after the command name; they reach the command as environment variables (also seen by
# worker processes it starts)
GLOBAL_FLAGS = {"--debug": "MEGATRON_PPO_DEBUG", "--verbose": "MEGATRON_PPO_VERBOSE"}


def _usage() -> str:
    lines = ["usage: megatron-ppo [--version] [--debug] [--verbose] <command> [args]", "", "commands:"]
    lines += [f"  {name:<12}{help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "  --debug     show tracebacks (always written to the run's log file)",
              "  --verbose   show library logs (Megatron config dumps, TE/Apex warnings)"]
    return "\n".join(lines)


def _take_global_flags(argv: list[str]) -> list[str]:
    rest = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return rest + argv[i:]
        if arg in GLOBAL_FLAGS:
            os.environ[GLOBAL_FLAGS[arg]] = "1"
        else:
            rest.append(arg)
    return rest


def main(argv: list[str] | None = None) -> int:
    argv = _take_global_flags(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("--version", "-V", "version"):
        print(f"megatron-ppo {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatron-ppo: unknown command {name!r}; choose one of {sorted(COMMANDS)} (megatron-ppo --help)",
              file=sys.stderr)
        return 2
    from megatron_ppo import console

    previous, before = console.handle_signals(), console.child_pids()
    try:
        module = importlib.import_module(COMMANDS[name][0])
        code = int(module.main(rest) or 0)
        if code == 0 and console.received() is not None:  # the Interrupted raised by the handler was swallowed somewhere
            raise console.Interrupted(console.received())
        return code
    except SystemExit as exc:  # argparse (2), or a command's SystemExit("message"): a run that stopped (exit 1)
        if isinstance(exc.code, str):  # refusals are UsageError (megatron_ppo/errors.py), handled below: exit 2
            print(exc.code, file=sys.stderr, flush=True)
            return 1
        return 0 if exc.code is None else int(exc.code)
    except BaseException as exc:  # noqa: BLE001 - every error becomes one line and an exit code
        return console.report_error(name, exc)
    finally:
        console.restore_signals(previous)
        console.kill_children(timeout=3.0, spare=before)


if __name__ == "__main__":
    sys.exit(main())
