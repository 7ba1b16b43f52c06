"""Checkpoints across megatron-core versions (issue 23). A checkpoint records the megatron-core that wrote it; one
this megatron-core cannot read is refused naming both versions, before dist_checkpointing fails deep inside
(0.16.1 on a 0.19 checkpoint: ``AttributeError: 'str' object has no attribute 'iterdir'``).

Two kinds of test:
- simulated (any version, seconds): a real checkpoint of this version whose stored version is rewritten;
- real (slow): a checkpoint and a cached conversion written by megatron-core 0.19 in a subprocess (the overlay of
  ``make setup-mcore-next``, docs/models.md), read here by the venv's older megatron-core. Skipped without the
  overlay, unless MPPO_MCORE_NEXT names it (CI): then a missing overlay fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ppo.compat import mcore

ROOT = Path(__file__).resolve().parents[2]


def _newer_than_readable(monkeypatch) -> str:
    """A writer version this megatron-core cannot read: 0.19.2 below 0.19; on 0.19+ (no known later change) a
    format change in the next minor version is added for the test."""
    if mcore.version_tuple() < mcore.COMMON_STATE_IN_SHARDS:
        return "0.19.2"
    major, minor, _ = mcore.version_tuple()
    monkeypatch.setattr(mcore, "FORMAT_CHANGES", mcore.FORMAT_CHANGES + (((major, minor + 1, 0), "simulated"),))
    return f"{major}.{minor + 1}.0"


def _restamp(path: Path, version: str | None) -> None:
    meta = json.loads(path.read_text())
    if version is None:
        del meta["megatron_core"]
    else:
        meta["megatron_core"] = version
    path.write_text(json.dumps(meta))


def test_model_checkpoint_from_a_newer_megatron_core_is_refused_naming_both(megatron_single, tmp_path, monkeypatch):
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.checkpoint import META_FILE, load_checkpoint, save_checkpoint
    from megatron_ppo.models.gpt import build_gpt_model

    ckpt = tmp_path / "actor"
    save_checkpoint(build_gpt_model(tiny_arch(), role="actor"), str(ckpt))
    assert json.loads((ckpt / META_FILE).read_text())["megatron_core"] == mcore.version()
    newer = _newer_than_readable(monkeypatch)
    _restamp(ckpt / META_FILE, newer)
    with pytest.raises(mcore.McoreVersionError, match=rf"{ckpt} was written by megatron-core {newer}; this is "
                                                      rf"megatron-core {mcore.version()}, which cannot read it"):
        load_checkpoint(build_gpt_model(tiny_arch(), role="actor"), str(ckpt))
    _restamp(ckpt / META_FILE, "0.16.1")  # an older writer: loads
    load_checkpoint(build_gpt_model(tiny_arch(), role="actor"), str(ckpt))
    _restamp(ckpt / META_FILE, None)  # written before the version was stored: the layout on disk decides
    load_checkpoint(build_gpt_model(tiny_arch(), role="actor"), str(ckpt))


def test_conversion_from_a_newer_megatron_core_is_refused_naming_both(tmp_path, monkeypatch):
    from megatron_ppo.convert.mapping import ConversionError
    from megatron_ppo.convert.pipeline import MANIFEST, hf_to_mcore, mcore_to_hf
    from megatron_ppo.testing.tiny_hf import make_tiny_hf

    hf_to_mcore(make_tiny_hf("qwen2", str(tmp_path / "hf")), str(tmp_path / "m"), quiet=True)
    manifest = tmp_path / "m" / MANIFEST
    assert json.loads(manifest.read_text())["megatron_core"] == mcore.version()
    newer = _newer_than_readable(monkeypatch)
    _restamp(manifest, newer)
    with pytest.raises(ConversionError, match=rf"{tmp_path / 'm'} was written by megatron-core {newer}; this is "
                                              rf"megatron-core {mcore.version()}"):
        mcore_to_hf(str(tmp_path / "m"), str(tmp_path / "back"), quiet=True)
    assert not (tmp_path / "back").exists()


# ----------------------------------------------------------------------------------------------------------------
# Real: written by megatron-core 0.19 (the overlay), read by this older one
# ----------------------------------------------------------------------------------------------------------------
WRITER = """
import sys


def main():
    from megatron_ppo import parallel
    from megatron_ppo.compat import mcore
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.checkpoint import save_checkpoint
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.convert.hf_import import converted_checkpoint

    out, hf = sys.argv[1], sys.argv[2]
    converted_checkpoint(hf, out + "/hf_import")  # the trainer's cache of converted HF models
    parallel.initialize(tp=1, pp=1, seed=1)
    try:
        save_checkpoint(build_gpt_model(tiny_arch(), role="actor"), out + "/actor")
    finally:
        parallel.destroy()
    print("megatron-core", mcore.version(), "wrote", out)


if __name__ == "__main__":
    main()
"""


def _overlay() -> Path | None:
    named = os.environ.get("MPPO_MCORE_NEXT")
    path = Path(named) if named else ROOT / ".mcore-0.19.2"
    if not path.is_absolute():
        path = ROOT / path
    if not (path / "megatron" / "core").is_dir():
        if named:
            pytest.fail(f"MPPO_MCORE_NEXT={named}: no megatron-core there (make setup-mcore-next)")
        return None
    return path


@pytest.mark.slow
def test_real_cross_version_checkpoints(megatron_single, tmp_path):
    """The overlay's megatron-core (0.19.2 by default) writes; this older one reads: refused by name when the
    overlay is 0.19+, loaded when it is not (`make test-mcore-next MCORE_NEXT=0.18.2`: 0.16.1 reads 0.18.2's)."""
    from megatron_ppo.convert.mapping import ConversionError, arch_from_hf_config
    from megatron_ppo.convert.pipeline import mcore_to_hf
    from megatron_ppo.models.arch import tiny_arch
    from megatron_ppo.models.checkpoint import META_FILE, load_checkpoint
    from megatron_ppo.models.gpt import build_gpt_model
    from megatron_ppo.testing.tiny_hf import make_tiny_hf
    from megatron_ppo.convert.hf_import import converted_checkpoint, load_hf_weights

    overlay = _overlay()
    if mcore.version_tuple() >= mcore.COMMON_STATE_IN_SHARDS:
        pytest.skip(f"megatron-core {mcore.version()} reads every supported version's checkpoints")
    if overlay is None:
        pytest.skip("no megatron-core 0.19 overlay (make setup-mcore-next)")
    script = tmp_path / "write.py"
    script.write_text(WRITER)
    hf = make_tiny_hf("llama", str(tmp_path / "hf"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(overlay), os.environ.get("PYTHONPATH")])),
           "NO_VCS_VERSION": "1"}
    env.pop("MPPO_EXPECT_MCORE", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), hf], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    writer = proc.stdout.split("megatron-core ")[1].split()[0]
    assert mcore.parse_version(writer) > mcore.version_tuple(), (writer, mcore.version())
    actor, cache = tmp_path / "out" / "actor", str(tmp_path / "out" / "hf_import")
    converted = converted_checkpoint(hf, cache)  # the child's conversion (a cache hit: nothing converted here)
    if mcore.parse_version(writer) < mcore.COMMON_STATE_IN_SHARDS:  # no format change between us: it loads
        load_checkpoint(build_gpt_model(tiny_arch(), role="actor"), str(actor))
        load_hf_weights(build_gpt_model(arch_from_hf_config(hf), "actor"), "actor", hf)
        mcore_to_hf(str(converted), str(tmp_path / "back"), quiet=True)
        return
    assert not (actor / "common.pt").exists() and not (converted / "common.pt").exists()  # the 0.19 layout

    both = rf"written by megatron-core {writer}; this is megatron-core {mcore.version()}, which cannot read it"
    with pytest.raises(mcore.McoreVersionError, match=both):
        load_checkpoint(build_gpt_model(tiny_arch(), role="actor"), str(actor))
    with pytest.raises(ConversionError, match=both):
        mcore_to_hf(str(converted), str(tmp_path / "back"), quiet=True)
    # a run starting from the HF model reads the HF files, never a converted cache: a newer writer cannot block it
    load_hf_weights(build_gpt_model(arch_from_hf_config(hf), "actor"), "actor", hf, cache)
    _restamp(actor / META_FILE, None)  # no stored version: refused from the layout on disk
    with pytest.raises(mcore.McoreVersionError, match=r"written by megatron-core >= 0\.19\.0"):
        load_checkpoint(build_gpt_model(tiny_arch(), role="actor"), str(actor))


def _rank_version(rank, world):
    from megatron_ppo.compat import mcore as m

    return m.version()


@pytest.mark.slow
def test_ranks_import_the_same_megatron_core(dist_pool2):
    """The spawned ranks see the parent's megatron-core (the overlay reaches them, not only the test process)."""
    assert dist_pool2.run(_rank_version) == [mcore.version()] * 2
