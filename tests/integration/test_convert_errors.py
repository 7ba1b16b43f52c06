"""Bad checkpoints fail loudly, name the culprit, and leave no partial output behind."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_ppo.convert import mcore_io as convert_mcore_io
from megatron_ppo.convert.cli import main as convert_main
from megatron_ppo.convert.mapping import ConversionError
from megatron_ppo.convert.pipeline import hf_to_mcore, mcore_to_hf
from megatron_ppo.testing.tiny_hf import make_tiny_hf


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf("llama", str(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def tiny_mcore(tiny_llama, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mcore") / "llama")
    hf_to_mcore(tiny_llama, out, quiet=True)
    return out


def variant(src: str, dst, edit) -> str:
    """A copy of the HF dir ``src`` whose model.safetensors went through ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = edit(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def assert_no_output(out_dir) -> None:
    """Neither the output nor a temporary sibling of it exists."""
    out_dir = str(out_dir)
    assert not os.path.exists(out_dir)
    parent, base = os.path.dirname(out_dir), os.path.basename(out_dir)
    assert [n for n in os.listdir(parent) if n.startswith(f".{base}.")] == []


def convert_fails(hf_dir, out_dir, *fragments, **kwargs):
    with pytest.raises(ConversionError) as info:
        hf_to_mcore(hf_dir, str(out_dir), quiet=True, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert_no_output(out_dir)
    return str(info.value)


def test_missing_tensor(tiny_llama, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    src = variant(tiny_llama, tmp_path / "hf", lambda t: {k: v for k, v in t.items() if k != name})
    convert_fails(src, tmp_path / "out", "missing tensors", name)


def test_extra_unknown_tensor(tiny_llama, tmp_path):
    name = "model.layers.0.mlp.extra_proj.weight"
    src = variant(tiny_llama, tmp_path / "hf", lambda t: {**t, name: torch.zeros(3, 3)})
    convert_fails(src, tmp_path / "out", "unknown tensors", name)


def test_wrong_shape(tiny_llama, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    src = variant(tiny_llama, tmp_path / "hf", lambda t: {**t, name: torch.zeros(16, 64)})
    convert_fails(src, tmp_path / "out", name, "(16, 64)", "expected (32, 64)")


def test_truncated_safetensors(tiny_llama, tmp_path):
    src = shutil.copytree(tiny_llama, tmp_path / "hf")
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    convert_fails(str(src), tmp_path / "out", path, "not a valid safetensors file")


def test_cli_reports_the_error_and_exits_2(tiny_llama, tmp_path, capsys):
    """A checkpoint that cannot be converted is a data error: exit 2, as the README's table says (issue 49)."""
    name = "model.norm.weight"
    src = variant(tiny_llama, tmp_path / "hf", lambda t: {k: v for k, v in t.items() if k != name})
    assert convert_main(["hf-to-mcore", "--hf", src, "--out", str(tmp_path / "out")]) == 2
    assert name in capsys.readouterr().err
    assert_no_output(tmp_path / "out")


def test_failure_in_the_middle_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    real = convert_mcore_io.DistCheckpointWriter.save_piece
    calls = []

    def failing(self, name, sharded):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("disk full (injected)")
        return real(self, name, sharded)

    monkeypatch.setattr(convert_mcore_io.DistCheckpointWriter, "save_piece", failing)
    with pytest.raises(OSError, match="injected"):
        hf_to_mcore(tiny_llama, str(tmp_path / "out"), quiet=True)
    assert len(calls) == 3
    assert_no_output(tmp_path / "out")


def test_tied_lm_head_must_equal_embedding(tmp_path):
    tied = make_tiny_hf("qwen2", str(tmp_path / "tied"))
    # A tied checkpoint that also stores lm_head: accepted (and skipped) when it equals the embedding ...
    same = variant(tied, tmp_path / "same", lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()})
    report = hf_to_mcore(same, str(tmp_path / "ok"), quiet=True)
    assert report.ledger["skipped"] == {"tied duplicate of the embedding (checked equal)": 1}
    # ... an error when it differs.
    differs = variant(tied, tmp_path / "differs",
                      lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1})
    convert_fails(differs, tmp_path / "out", "lm_head.weight differs")


def test_a_role_from_hf_weights_refuses_a_bad_checkpoint_by_name(tiny_llama, tmp_path, megatron_single):
    """load_hf_weights (each rank reading its slices) keeps the converter's checks: a wrong shape or an unknown
    tensor named before anything is read, a stored tied lm_head that differs from the embedding named by rows;
    an equal one is loaded and skipped."""
    from megatron_ppo.convert.hf_import import load_hf_weights
    from megatron_ppo.convert.mapping import arch_from_hf_config
    from megatron_ppo.models.gpt import build_gpt_model

    def load(hf_dir):
        return load_hf_weights(build_gpt_model(arch_from_hf_config(hf_dir), "actor"), "actor", hf_dir)

    name = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ConversionError, match=rf"'{name}' .* has shape \(16, 64\), expected \(32, 64\)"):
        load(variant(tiny_llama, tmp_path / "shape", lambda t: {**t, name: torch.zeros(16, 64)}))
    extra = "model.layers.0.mlp.extra_proj.weight"
    with pytest.raises(ConversionError, match=rf"unknown tensors \['{extra}'\]"):
        load(variant(tiny_llama, tmp_path / "extra", lambda t: {**t, extra: torch.zeros(3, 3)}))
    tied = make_tiny_hf("qwen2", str(tmp_path / "tied"), tokenizer=False)
    with pytest.raises(ConversionError, match=r"lm_head.weight differs from model.embed_tokens.weight \(rows 0:300\)"):
        load(variant(tied, tmp_path / "differs", lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    same = variant(tied, tmp_path / "same", lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()})
    assert load(same).params_in == load(tied).params_in


def test_derived_rotary_buffers_are_skipped_and_counted(tiny_llama, tmp_path):
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(4)}
    src = variant(tiny_llama, tmp_path / "hf", lambda t: {**t, **buffers})
    report = hf_to_mcore(src, str(tmp_path / "out"), quiet=True)
    assert report.ledger["skipped"] == {"derived buffer (rotary inv_freq, recomputed)": 4}


def test_unsupported_architecture_and_impossible_layout(tiny_llama, tmp_path):
    import json

    src = shutil.copytree(tiny_llama, tmp_path / "hf")
    with open(src / "config.json") as f:
        cfg = json.load(f)
    convert_fails(str(src), tmp_path / "out", "num_attention_heads=4 is not divisible by tp=3", tp=3)
    convert_fails(str(src), tmp_path / "out", "num_layers=4 is not divisible by pp=3", pp=3)
    cfg["model_type"] = "gpt2"
    with open(src / "config.json", "w") as f:
        json.dump(cfg, f)
    convert_fails(str(src), tmp_path / "out", "model_type 'gpt2' is not supported")


def test_existing_output_is_kept_unless_overwrite(tiny_llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="not empty"):
        hf_to_mcore(tiny_llama, str(out), quiet=True)
    assert (out / "precious.txt").read_text() == "keep me"
    hf_to_mcore(tiny_llama, str(out), overwrite=True, quiet=True)
    assert not (out / "precious.txt").exists() and (out / ".metadata").exists()


# ---------------------------------------------------------------------------------------------------------------
# Megatron -> HF
# ---------------------------------------------------------------------------------------------------------------
def mcore_variant(src: str, dst, drop_prefix: str) -> str:
    """A copy of the dist checkpoint whose .metadata no longer lists keys starting with ``drop_prefix``."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # our own test checkpoint
    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if not k.startswith(drop_prefix)}
    md.storage_data = {k: v for k, v in md.storage_data.items() if not k.fqn.startswith(drop_prefix)}
    with open(path, "wb") as f:
        pickle.dump(md, f)
    return str(dst)


def export_fails(mcore_dir, out_dir, *fragments, **kwargs):
    with pytest.raises(ConversionError) as info:
        mcore_to_hf(mcore_dir, str(out_dir), quiet=True, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert_no_output(out_dir)


def test_mcore_missing_tensor(tiny_mcore, tmp_path):
    key = "decoder.layers.mlp.linear_fc2.weight"
    src = mcore_variant(tiny_mcore, tmp_path / "m", key)
    export_fails(src, tmp_path / "out", "missing tensor", key)


def test_mcore_config_mismatch(tiny_mcore, tmp_path):
    import json

    cfg_dir = shutil.copytree(os.path.join(tiny_mcore, "hf_config"), tmp_path / "cfg")
    with open(cfg_dir / "config.json") as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 6
    with open(cfg_dir / "config.json", "w") as f:
        json.dump(cfg, f)
    export_fails(tiny_mcore, tmp_path / "out", "stacks 4 layers, the config has 6", hf_config=str(cfg_dir))


def test_mcore_not_a_checkpoint_and_no_config(tiny_mcore, tmp_path):
    (tmp_path / "empty").mkdir()
    export_fails(str(tmp_path / "empty"), tmp_path / "out", "no HF config")
    export_fails(str(tmp_path / "empty"), tmp_path / "out", "not a Megatron dist_checkpointing checkpoint",
                 hf_config=os.path.join(tiny_mcore, "hf_config"))
