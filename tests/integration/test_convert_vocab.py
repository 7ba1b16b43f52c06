"""HF <-> Megatron conversion never zero-fills or truncates real vocabulary rows: a vocab tensor whose row count is
neither the config's vocab_size nor megatron's padding of it (at a TP the model allows) is a ConversionError naming
the tensor and the counts."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megatron_ppo.models.arch import tiny_arch
from megatron_ppo.convert.mapping import HF_EMBED, ConversionError, conversion_pieces, to_hf, to_mcore
from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf
from megatron_ppo.testing.tiny_hf import make_tiny_hf

ARCH = tiny_arch(vocab_size=300)  # 4 heads: padded 384 at TP 1, 512 at TP 2 and 4


def _embedding_map(tp):
    return conversion_pieces(ARCH, tp)[0].maps[0]


def test_to_mcore_rejects_hf_rows_other_than_the_vocab():
    m = _embedding_map(1)
    for rows in (299, 301):
        with pytest.raises(ConversionError, match=rf"{HF_EMBED}: {rows} rows, the config's vocab_size is 300"):
            to_mcore(m, {HF_EMBED: torch.ones(rows, ARCH.hidden_size)}, ARCH)
    out = to_mcore(m, {HF_EMBED: torch.ones(300, ARCH.hidden_size)}, ARCH)
    assert out.shape == (384, ARCH.hidden_size) and out[:300].all() and not out[300:].any()


@pytest.mark.parametrize("rows", [299, 400, 640, 1024])
def test_to_hf_rejects_rows_that_are_not_this_vocab_or_its_padding(rows):
    m = _embedding_map(1)
    with pytest.raises(ConversionError) as e:
        to_hf(m, torch.ones(rows, ARCH.hidden_size), ARCH)
    assert "embedding.word_embeddings.weight" in str(e.value) and f"{rows} rows" in str(e.value)


@pytest.mark.parametrize("rows", [300, 384, 512])  # unpadded, TP1's padding, TP2/TP4's padding
def test_to_hf_drops_only_padding(rows):
    t = torch.arange(rows, dtype=torch.float32).unsqueeze(1).repeat(1, ARCH.hidden_size)
    back, dropped = to_hf(_embedding_map(1), t, ARCH)
    assert torch.equal(back[HF_EMBED], t[:300]) and dropped.shape[0] == rows - 300


@pytest.fixture(scope="module")
def tiny_mcore(tmp_path_factory):
    hf = make_tiny_hf("llama", str(tmp_path_factory.mktemp("tiny") / "llama"))  # 300 tokens, 4 heads
    out = str(tmp_path_factory.mktemp("mcore") / "llama")
    hf_to_mcore(hf, out, quiet=True)  # TP1: 384 rows
    return out


def _config_with_vocab(tiny_mcore, dst, vocab):
    cfg_dir = shutil.copytree(os.path.join(tiny_mcore, "hf_config"), dst)
    with open(cfg_dir / "config.json") as f:
        cfg = json.load(f)
    cfg["vocab_size"] = vocab
    with open(cfg_dir / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(cfg_dir)


@pytest.mark.parametrize("vocab", [200, 400])
def test_export_with_a_config_of_another_vocab_fails(tiny_mcore, tmp_path, vocab):
    """384 stored rows (300 real tokens): a 200-token config would keep 200 and drop 100 real tokens; a 400-token
    config has more tokens than the checkpoint."""
    cfg = _config_with_vocab(tiny_mcore, tmp_path / "cfg", vocab)
    with pytest.raises(ConversionError) as e:
        mcore_to_hf(tiny_mcore, str(tmp_path / "out"), hf_config=cfg, quiet=True)
    msg = str(e.value)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert f"'{key}' has shape (384, 64)" in msg, msg
    assert "384 rows" in msg and f"vocab of {vocab} tokens" in msg, msg
    assert not os.path.exists(tmp_path / "out")
