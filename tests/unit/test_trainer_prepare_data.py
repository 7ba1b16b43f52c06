"""prepare_data: preprocessing runs only when its own outputs are missing; a wrong data path is an error naming
the key, raised before anything (tokenizer, models) is built."""
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_ppo.config import load_config
from megatron_ppo.trainer.components import build_components, prepare_data


def _raw(folder: Path, n_train: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", 2)):
        (folder / f"{split}.jsonl").write_text(
            "".join(json.dumps({"question": f"q{i}?", "answer": f"{i}\n#### {i}"}) + "\n" for i in range(n)))
    return folder


def _cfg(tmp_path: Path, train: str, val: str):
    # no tokenizer build (tokenizer_path is only read after prepare_data): the test is about the data paths
    return load_config("tiny_cpu", [
        "data.preprocess.dataset=gsm8k",  # tiny_cpu's own is the generated arithmetic task
        f"data.preprocess.input_dir={tmp_path / 'raw'}", f"data.preprocess.output_dir={tmp_path / 'pre'}",
        "data.preprocess.build_tokenizer=false", f"actor.model.tokenizer_path={tmp_path / 'no_tokenizer'}",
        f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"trainer.log_dir={tmp_path / 'logs'}"])


def _rows(path: Path) -> int:
    return pq.read_metadata(path).num_rows


@pytest.fixture
def prepared(tmp_path):
    """The preprocessing outputs exist (3 train rows); the raw input then grows to 7 rows, so a re-run shows."""
    _raw(tmp_path / "raw", 3)
    pre = tmp_path / "pre"
    assert prepare_data(_cfg(tmp_path, pre / "train.parquet", pre / "test.parquet")) is None
    assert _rows(pre / "train.parquet") == 3
    _raw(tmp_path / "raw", 7)
    return tmp_path


def test_a_directory_of_parquet_files_is_read_and_does_not_rerun_preprocessing(prepared):
    mine = prepared / "mine"
    mine.mkdir()
    shutil.copy(prepared / "pre" / "train.parquet", mine / "a.parquet")
    prepare_data(_cfg(prepared, mine, prepared / "pre" / "test.parquet"))
    prepare_data(_cfg(prepared, mine, prepared / "pre" / "test.parquet"))
    assert _rows(prepared / "pre" / "train.parquet") == 3  # not rewritten from the grown raw input


@pytest.mark.parametrize("key, index", [("train_files", 1), ("val_files", 0)])
def test_a_mistyped_path_is_an_error_naming_the_key_and_rewrites_nothing(prepared, key, index):
    pre = prepared / "pre"
    train = f"{pre / 'train.parquet'}, {pre / 'trian.parquet'}" if key == "train_files" else pre / "train.parquet"
    val = pre / "tset.parquet" if key == "val_files" else pre / "test.parquet"
    typo = "trian.parquet" if key == "train_files" else "tset.parquet"
    with pytest.raises(FileNotFoundError, match=rf"data\.{key}\[{index}\]: .*{typo} does not exist"):
        prepare_data(_cfg(prepared, train, val))
    assert _rows(pre / "train.parquet") == 3


def test_an_empty_directory_is_an_error_naming_the_key(prepared):
    (prepared / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data\.train_files\[0\]: directory .*empty holds no \*\.parquet"):
        prepare_data(_cfg(prepared, prepared / "empty", prepared / "pre" / "test.parquet"))


def test_missing_outputs_are_built_and_a_wrong_path_fails_before_any_model(tmp_path):
    _raw(tmp_path / "raw", 3)
    with pytest.raises(FileNotFoundError, match=r"data\.train_files\[0\]: .*nope\.parquet does not exist"):
        build_components(_cfg(tmp_path, tmp_path / "nope.parquet", tmp_path / "pre" / "test.parquet"))
    assert _rows(tmp_path / "pre" / "train.parquet") == 3  # its own outputs were missing: built once
