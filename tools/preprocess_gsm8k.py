#!/usr/bin/env python
"""GSM8K -> verl-schema parquet; same as `megatron-ppo preprocess gsm8k ...`.

    python tools/preprocess_gsm8k.py --input ../shared/data/gsm8k --out data/gsm8k
"""
import sys

from megatron_ppo.data.preprocess import main

if __name__ == "__main__":
    sys.exit(main(["gsm8k", *sys.argv[1:]]))
