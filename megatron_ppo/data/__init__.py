"""Data in and out: verl-schema prompt parquet, GSM8K preprocessing, the tokenizer, prompt and trajectory datasets,
the resumable sampler, sequence packing (THD) and token-budget micro-batches.

Modules are imported directly (e.g. `from megatron_ppo.data.packing import PackLayout`) so that importing one piece
does not pull in transformers or torch where it is not needed.
"""
