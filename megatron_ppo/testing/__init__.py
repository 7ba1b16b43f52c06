"""Helpers for the tests and tools, not used by the product:

  tiny_hf.py     tiny random HF Llama/Qwen2 models on disk (conversion tests)
  conversion.py  conversion round-trip proofs: bitwise HF checkpoint comparison, cache-free greedy decode
  sharding.py    full TP1/PP1 state dict <-> this rank's shard (model tests, small models)
  training.py    one optimizer step over micro-batches (model tests)
  backends.py    select the ops backend under test (tests/unit/test_ops_*.py, tools/gpu_check.sh)
  probes.py      role workers with probes (checksum, peak_rss_mb): build_components(worker_classes=PROBED_WORKERS)
  gpu_step.py    the device script's bf16 PPO step on a Qwen2.5-0.5B-shaped model, with MFU (tools/gpu_check.sh)
"""
