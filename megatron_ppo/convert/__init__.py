"""HF <-> Megatron checkpoint conversion (`megatron-ppo convert`), separate from models/ which builds and runs
models.

  mapping.py   the pure HF <-> Megatron-core name/layout mapping for Llama and Qwen2
  hf_io.py     HF side: read safetensors/bin tensors on demand, write sharded safetensors, copy config files
  mcore_io.py  Megatron side: a dist_checkpointing checkpoint written and read piece by piece
  ledger.py    completeness accounting (every tensor consumed and written exactly once)
  report.py    what a conversion reports: time, peak memory, the summary table
  pipeline.py  hf_to_mcore / mcore_to_hf: the two directions, orchestrated
  verify.py    logits of the converted Megatron model against the HF model's
  cli.py       the command line
  hf_slices.py a rank's slices of an HF checkpoint: what it reads (row_segments), read into its parameters in place
  hf_import.py a run's roles started from an HF model: headers checked in the driver, slices read by each rank
"""
