"""`megatron-ppo <command> [args]`: one entry point, each command owned by the module that implements it.

Commands are imported lazily so that `megatron-ppo preprocess` does not pay for importing Megatron or Ray.
Each command module exposes `main(argv: list[str]) -> int`.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("megatron_ppo.trainer.entry", "run PPO from a YAML config (default: configs/tiny_cpu.yaml)"),
    "preprocess": ("megatron_ppo.data.preprocess", "convert raw datasets (gsm8k) to verl-schema parquet"),
    "convert": ("megatron_ppo.convert.cli", "HF <-> Megatron checkpoint conversion (hf-to-mcore, mcore-to-hf)"),
    "plot": ("megatron_ppo.trainer.plots", "PNG curves of a run from its metrics.jsonl (megatron-ppo plot DIR)"),
    "plan": ("megatron_ppo.plan.cli", "per-GPU memory, feasible TP/PP/DP layouts and step time of a config"),
}


def _usage() -> str:
    lines = ["usage: megatron-ppo <command> [args]", "", "commands:"]
    lines += [f"  {name:<12}{help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatron-ppo: unknown command {name!r}; choose one of {sorted(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
