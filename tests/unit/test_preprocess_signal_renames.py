"""A SIGTERM/SIGINT while a preprocessed set is moved into place (issue 15): the renames all happen, then the run
stops; never a new manifest and train.parquet beside an old or missing test.parquet. Real signals to this process."""
from __future__ import annotations

import os
import signal

import pyarrow as pa
import pytest

from megatron_ppo import console
from megatron_ppo.data import manifest
from megatron_ppo.data.manifest import MANIFEST_NAME, check_against_manifest, write_set


@pytest.fixture
def our_handlers():
    previous = console.handle_signals()
    yield
    console.restore_signals(previous)


def test_deferred_signals_hold_the_signal_until_the_block_ends(our_handlers):
    done = []
    with pytest.raises(console.Interrupted) as info:
        with console.deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("after the signal")  # still runs: the signal is held
    assert done == ["after the signal"] and info.value.exit_code == 143
    with pytest.raises(console.Interrupted):  # the usual handler is back
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_between_renames_leaves_the_complete_set(our_handlers, tmp_path, monkeypatch, sig):
    out = tmp_path / "data"
    write_set(out, {"train.parquet": pa.table({"x": [1, 2]}), "test.parquet": pa.table({"x": [3]})})
    real_replace, calls = os.replace, []

    def replace_then_signal(src, dst):  # a signal right after the manifest landed, before the data files
        real_replace(src, dst)
        calls.append(os.path.basename(dst))
        if len(calls) == 1:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(manifest.os, "replace", replace_then_signal)
    with pytest.raises(console.Interrupted):
        write_set(out, {"train.parquet": pa.table({"x": [10, 20, 30]}), "test.parquet": pa.table({"x": [40]})})
    assert calls == [MANIFEST_NAME, "train.parquet", "test.parquet"]
    for name in ("train.parquet", "test.parquet"):
        check_against_manifest(out / name)  # every file is the one the new manifest records
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # the temp dir is gone
