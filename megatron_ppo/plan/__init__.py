"""The parallelism planner (`megatron-ppo plan`): per-GPU memory and step time of PPO layouts, from formulas that
tests/unit/test_plan*.py check against hand numbers and real Megatron models (docs/scaling.md)."""
from megatron_ppo.plan.memory import (Hardware, Layout, Memory, Workload, layer_params, memory, stage_params,
                                      total_params)

__all__ = ["Hardware", "Layout", "Memory", "Workload", "layer_params", "memory", "stage_params", "total_params"]
