"""compat/mcore.py: the megatron-core version range, the version guard of CI's overlay stage, the common-state
layout, and the refusal rule for checkpoints written by a newer megatron-core (versions simulated: no checkpoint
is written here; tests/integration/test_mcore_versions.py writes real ones)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from megatron_ppo.compat import mcore

ROOT = Path(__file__).resolve().parents[2]


def test_the_expected_megatron_core_is_imported():
    """The guard: with MPPO_EXPECT_MCORE set (CI's overlay stage) the imported megatron-core is that version, so a
    stage whose overlay stopped applying fails instead of testing the venv's version again."""
    import megatron.core

    have = mcore.version()
    want = os.environ.get("MPPO_EXPECT_MCORE")
    if want:
        assert mcore.parse_version(have) == mcore.parse_version(want), (have, megatron.core.__file__)
    low, high = (0, 16, 1), (0, 20, 0)
    assert low <= mcore.parse_version(have) < high, f"megatron-core {have} is outside {mcore.SUPPORTED}"


def test_the_guard_fails_on_another_version(monkeypatch):
    monkeypatch.setenv("MPPO_EXPECT_MCORE", "0.15.0")
    with pytest.raises(RuntimeError, match=rf"MPPO_EXPECT_MCORE=0.15.0, but megatron-core {mcore.version()} is "
                                           "imported .*overlay did not apply"):
        mcore.check_expected()
    monkeypatch.setenv("MPPO_EXPECT_MCORE", mcore.version())
    mcore.check_expected()


def test_setup_py_requires_the_supported_range():
    spec = re.search(r'"megatron-core([^"]*)"', (ROOT / "setup.py").read_text())
    assert spec and spec.group(1) == mcore.SUPPORTED


@pytest.mark.parametrize("text,want", [("0.16.1", (0, 16, 1)), ("0.19.2+6e8dfc7", (0, 19, 2)),
                                       ("0.19.0rc1", (0, 19, 0)), ("0.20", (0, 20, 0))])
def test_parse_version(text, want):
    assert mcore.parse_version(text) == want


def test_common_state_keys():
    assert mcore.is_common_state_key("common_state/shard_0_1")
    assert not mcore.is_common_state_key("decoder.layers.self_attention.linear_proj._extra_state/shard_0_4")
    assert mcore.common_state_files() == (() if mcore.version_tuple() >= (0, 19, 0) else ("common.pt",))


def _as(monkeypatch, reader: str):
    monkeypatch.setattr(mcore, "version", lambda: reader)


@pytest.mark.parametrize("reader,writer", [("0.16.1", "0.19.2"), ("0.18.2", "0.19.0"), ("0.17.1", "0.19.2+abc")])
def test_a_newer_writer_past_the_layout_change_is_refused_naming_both(monkeypatch, tmp_path, reader, writer):
    _as(monkeypatch, reader)
    with pytest.raises(mcore.McoreVersionError,
                       match=rf"written by megatron-core {re.escape(writer)}; this is megatron-core {reader}, which "
                             r"cannot read it \(since 0\.19\.0 the common state of a dist checkpoint is stored in "
                             r"its torch_dist shards.*Install megatron-core>=0\.19\."):
        mcore.check_readable(str(tmp_path), writer)


@pytest.mark.parametrize("reader,writer", [("0.16.1", "0.18.2"), ("0.16.1", "0.17.1"), ("0.16.1", "0.16.1"),
                                           ("0.19.2", "0.16.1"), ("0.19.2", "0.19.2"), ("0.19.0", "0.19.2")])
def test_readable_pairs_are_not_refused(monkeypatch, tmp_path, reader, writer):
    """Measured: 0.16.1 loads 0.17.1's and 0.18.2's model + optimizer checkpoints; 0.19 reads the older layout."""
    _as(monkeypatch, reader)
    mcore.check_readable(str(tmp_path), writer)


def test_without_a_stored_version_the_layout_on_disk_decides(monkeypatch, tmp_path):
    (tmp_path / "metadata.json").write_text("{}")
    _as(monkeypatch, "0.16.1")
    with pytest.raises(mcore.McoreVersionError, match=r"written by megatron-core >= 0\.19\.0; this is megatron-core "
                                                      r"0\.16\.1"):
        mcore.check_readable(str(tmp_path))
    _as(monkeypatch, "0.19.2")
    mcore.check_readable(str(tmp_path))
    (tmp_path / "common.pt").write_bytes(b"")
    _as(monkeypatch, "0.16.1")
    mcore.check_readable(str(tmp_path))
