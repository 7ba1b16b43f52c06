#!/usr/bin/env python
"""Megatron dist checkpoint -> HF safetensors directory; same as `megatron-ppo convert mcore-to-hf ...`.

  python tools/convert_mcore_to_hf.py --mcore DIR --out DIR [--hf-config DIR] [--dtype ...] [--max-shard-size 2GB]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ppo.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["mcore-to-hf", *sys.argv[1:]]))
