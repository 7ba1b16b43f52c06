#!/usr/bin/env python
"""HF Llama/Qwen2 directory -> Megatron dist checkpoint; same as `megatron-ppo convert hf-to-mcore ...`.

  python tools/convert_hf_to_mcore.py --hf DIR --out DIR [--tp N] [--pp M] [--dtype auto|fp32|bf16|fp16]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ppo.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["hf-to-mcore", *sys.argv[1:]]))
