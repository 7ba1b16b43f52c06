"""`megatron-ppo preprocess <dataset>`: raw datasets -> verl-schema parquet (and the project's small tokenizer).

    megatron-ppo preprocess gsm8k --input ../shared/data/gsm8k --out data/gsm8k
    megatron-ppo preprocess arithmetic --out data/arithmetic     # generated "What is 3 + 4?" -> #### 7 (tiny default)
    megatron-ppo preprocess tokenizer --input ../shared/data/gsm8k --out .cache/tokenizers
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pyarrow as pa

from megatron_ppo.data import arithmetic, gsm8k
from megatron_ppo.data.manifest import MANIFEST_NAME, sha256_file, write_set
from megatron_ppo.data.schema import GSM8K_PROMPT_SCHEMA

log = logging.getLogger(__name__)


def preprocess_gsm8k(input_dir: str | Path, out_dir: str | Path, splits=gsm8k.SPLITS) -> dict[str, int]:
    """Write `<out>/<split>.parquet` for each split; returns rows written per split (always = lines read).

    All splits are read and converted before anything is written, then written as one set with a manifest
    (`data/manifest.py`): a bad line anywhere leaves `out_dir` exactly as it was, never a new train.parquet beside
    an old test.parquet.
    """
    input_dir, out_dir = Path(input_dir), Path(out_dir)
    tables, sources = {}, {}
    for split in splits:
        src = input_dir / f"{split}.jsonl"
        if not src.is_file():
            raise FileNotFoundError(f"--input: {src} not found (expected GSM8K {split}.jsonl in {input_dir})")
        rows = gsm8k.read_jsonl(src, split)
        tables[f"{split}.parquet"] = pa.Table.from_pylist(rows, schema=GSM8K_PROMPT_SCHEMA)
        sources[src.name] = {"path": str(src.resolve()), "sha256": sha256_file(src)}
    write_set(out_dir, tables, {"dataset": "gsm8k", "sources": sources})
    counts = {}
    for split in splits:
        counts[split] = tables[f"{split}.parquet"].num_rows
        log.info("gsm8k %s: %d rows -> %s", split, counts[split], out_dir / f"{split}.parquet")
    return counts


def preprocess_arithmetic(out_dir: str | Path, train_rows: int = arithmetic.DEFAULT_ROWS["train"],
                          test_rows: int = arithmetic.DEFAULT_ROWS["test"], seed: int = 0,
                          level: str = "single") -> dict[str, int]:
    """Write the generated arithmetic task (data/arithmetic.py, ``level`` single or multi) as `<out>/train.parquet`
    and `test.parquet`, one set with a manifest like GSM8K's."""
    counts = {"train": train_rows, "test": test_rows}
    for split, n in counts.items():
        if n < 1:
            raise ValueError(f"arithmetic: {split} rows must be >= 1, got {n}")
    if level == "multi" and test_rows > arithmetic.test_pool_size():
        raise ValueError(f"arithmetic: level multi's held-out test pool holds {arithmetic.test_pool_size()} distinct "
                         f"questions; --test-rows {test_rows} is more")
    tables = {f"{split}.parquet": pa.Table.from_pylist(arithmetic.rows(split, n, seed, level),
                                                       schema=GSM8K_PROMPT_SCHEMA) for split, n in counts.items()}
    write_set(out_dir, tables, {"dataset": "arithmetic", "seed": seed, "rows": counts,
                                **({"level": level} if level != "single" else {})})
    log.info("arithmetic: %s rows -> %s", counts, out_dir)
    return counts


PREPROCESSORS = ("gsm8k", "arithmetic")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ppo preprocess", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="dataset", required=True)
    g = sub.add_parser("gsm8k", help="GSM8K train/test jsonl -> verl-schema parquet")
    g.add_argument("--input", default=str(gsm8k.default_gsm8k_dir()), help="folder with train.jsonl and test.jsonl")
    g.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    g.add_argument("--splits", nargs="+", default=list(gsm8k.SPLITS), choices=gsm8k.SPLITS)
    a = sub.add_parser("arithmetic", help="generated single-digit sums in GSM8K format (the tiny default's task)")
    a.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    a.add_argument("--train-rows", type=int, default=arithmetic.DEFAULT_ROWS["train"])
    a.add_argument("--test-rows", type=int, default=arithmetic.DEFAULT_ROWS["test"])
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--level", choices=arithmetic.LEVELS, default="single", help="single: one-digit sums (the tiny "
                   "default); multi: 1-2 digit + - x for a pretrained model, test questions held out of train")
    t = sub.add_parser("tokenizer", help="build the small byte-level BPE tokenizer from GSM8K text (cached)")
    t.add_argument("--input", default=str(gsm8k.default_gsm8k_dir()), help="folder with GSM8K train.jsonl")
    t.add_argument("--out", required=True, help="cache folder; the tokenizer goes in a sub-folder named by its key")
    t.add_argument("--vocab-size", type=int, default=None)
    return p


def _written_state(out: str | Path) -> bytes | None:
    """What marks `out` as a complete set: its manifest (written with the set's files), or None."""
    try:
        return (Path(out) / MANIFEST_NAME).read_bytes()
    except OSError:
        return None


def _interrupted_line(dataset: str, signal_name: str, out: str, before: bytes | None) -> str:
    """What an interrupted run left: the set in `out` is either complete or as it was (write_set moves it in with
    signals held, and its temp dir is removed on the way out)."""
    prog = f"megatron-ppo preprocess {dataset}"
    if dataset == "tokenizer":  # one directory renamed into the cache at the end
        return f"{prog}: interrupted by {signal_name}; no partial tokenizer left in {out} (temp dir removed)"
    if _written_state(out) != before:
        return (f"{prog}: interrupted by {signal_name} after {out} was complete (its files and {MANIFEST_NAME} are "
                "one finished set)")
    state = f"nothing was written; {out} is as it was" if before is not None or Path(out).exists() else \
        f"nothing was written to {out}"
    return f"{prog}: interrupted by {signal_name}; {state} (temp dir removed)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megatron_ppo import console

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    before = _written_state(args.out)
    try:
        if args.dataset == "gsm8k":
            counts = preprocess_gsm8k(args.input, args.out, args.splits)
            for split, n in counts.items():
                print(f"{split}: {n} rows -> {Path(args.out) / (split + '.parquet')}")
        elif args.dataset == "arithmetic":
            counts = preprocess_arithmetic(args.out, args.train_rows, args.test_rows, args.seed, args.level)
            for split, n in counts.items():
                print(f"{split}: {n} rows -> {Path(args.out) / (split + '.parquet')}")
        else:
            from megatron_ppo.data.tokenizer import DEFAULT_VOCAB_SIZE, gsm8k_tokenizer_dir

            path = gsm8k_tokenizer_dir(args.out, args.input, vocab_size=args.vocab_size or DEFAULT_VOCAB_SIZE)
            print(f"tokenizer: {path}")
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-ppo preprocess: error: {e}", file=sys.stderr)
        return 2
    except console.Interrupted as e:  # SIGINT/SIGTERM (cli.main's handlers): temp dir gone, set complete or untouched
        print(_interrupted_line(args.dataset, str(e), args.out, before), file=sys.stderr, flush=True)
        return e.exit_code
    if console.received() is not None:  # the signal's exception was swallowed somewhere (e.g. a logging callback)
        sig = console.Interrupted(console.received())
        print(_interrupted_line(args.dataset, str(sig), args.out, before), file=sys.stderr, flush=True)
        return sig.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
