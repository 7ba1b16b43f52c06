"""PPO math on plain tensors: advantages, losses, KL control, rollout correction.

No torch.distributed, Megatron or Ray here (tests/unit/test_algo_imports.py enforces it); parity with verl 0.9.1
is tested in tests/unit/test_algo_*.py and documented in docs/algo.md.
"""
