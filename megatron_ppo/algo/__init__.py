"""PPO math on plain tensors: advantages, losses, KL control, rollout correction.

No torch.distributed, Megatron or Ray here
(tests/unit/test_algo_checks.py::test_algo_never_imports_distributed_megatron_or_ray enforces it);
parity with verl 0.9.1 is tested in tests/unit/test_algo_*.py and documented in docs/algo.md.
"""
