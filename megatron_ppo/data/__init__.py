"""Data in and out: verl-schema prompt parquet, GSM8K preprocessing, the tokenizer, prompt and trajectory datasets,
the resumable sampler, the rollout batch with its packing (THD) and token-budget micro-batches (batch.py, the
one packer that the driver and the workers share).

Modules are imported directly (e.g. `from megatron_ppo.data.batch import RolloutBatch`) so that importing one piece
does not pull in transformers or torch where it is not needed.
"""
