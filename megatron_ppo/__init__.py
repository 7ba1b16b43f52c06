"""megatron_ppo: a PPO RLHF trainer for large language models built on Megatron-core."""

__version__ = "0.1.0"
