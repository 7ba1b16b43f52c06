"""GSM8K preprocessing on the real files: counts, schema, ground truths vs an independent extraction, bad lines."""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_ppo.data import gsm8k
from megatron_ppo.data.preprocess import main, preprocess_gsm8k
from megatron_ppo.data.schema import GSM8K_PROMPT_SCHEMA

RAW = gsm8k.default_gsm8k_dir()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    assert preprocess_gsm8k(RAW, out) == {"train": 7473, "test": 1319}
    return out


@pytest.mark.parametrize("split,rows", [("train", 7473), ("test", 1319)])
def test_real_gsm8k_counts_schema_and_ground_truths(out_dir, split, rows):
    table = pq.read_table(out_dir / f"{split}.parquet")
    assert table.schema.equals(GSM8K_PROMPT_SCHEMA)
    assert table.num_rows == rows
    raw = [json.loads(line) for line in open(RAW / f"{split}.jsonl", encoding="utf-8")]
    assert len(raw) == rows
    for i, (row, src) in enumerate(zip(table.to_pylist(), raw)):
        # independent extraction: the text after the last "####", commas dropped; every GSM8K final is an integer
        expected = src["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        int(expected)
        assert row["reward_model"] == {"style": "rule", "ground_truth": expected}
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": src["question"] + " " + gsm8k.INSTRUCTION}]
        assert row["extra_info"] == {"split": split, "index": i, "answer": src["answer"], "question": src["question"]}


def test_comma_finals_are_unformatted(out_dir):
    truths = pq.read_table(out_dir / "train.parquet").column("reward_model").to_pylist()
    raw = [json.loads(line)["answer"] for line in open(RAW / "train.jsonl", encoding="utf-8")]
    with_comma = [i for i, a in enumerate(raw) if "," in a.rsplit("####", 1)[1]]
    assert len(with_comma) == 79  # the README's count
    assert all("," not in truths[i]["ground_truth"] for i in with_comma)


def test_cli_and_tool_entry_points(tmp_path):
    from megatron_ppo.cli import main as cli_main

    assert cli_main(["preprocess", "gsm8k", "--input", str(RAW), "--out", str(tmp_path / "a"), "--splits", "test"]) == 0
    assert pq.read_metadata(tmp_path / "a" / "test.parquet").num_rows == 1319
    run = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_gsm8k.py"), "--input", str(RAW),
                          "--out", str(tmp_path / "b"), "--splits", "test"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert pq.read_table(tmp_path / "b" / "test.parquet").equals(pq.read_table(tmp_path / "a" / "test.parquet"))


GOOD = json.dumps({"question": "q?", "answer": "so 2\n#### 2"})


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"question": "q?"}), "'answer' missing"),
        (json.dumps({"question": 3, "answer": "#### 1"}), "'question' missing or not a string"),
        (json.dumps({"question": "q?", "answer": "no final line"}), "no final '#### N'"),
        (json.dumps(["question", "answer"]), "expected a JSON object"),
        ("", "empty line"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, capsys, bad_line, message):
    (tmp_path / "train.jsonl").write_text("\n".join([GOOD, GOOD, bad_line, GOOD]) + "\n")
    with pytest.raises(gsm8k.MalformedLineError, match=rf"train\.jsonl:3: .*{message}"):
        preprocess_gsm8k(tmp_path, tmp_path / "out", splits=("train",))
    assert not (tmp_path / "out" / "train.parquet").exists()
    assert main(["gsm8k", "--input", str(tmp_path), "--out", str(tmp_path / "out"), "--splits", "train"]) == 2
    assert "train.jsonl:3" in capsys.readouterr().err


def test_missing_input_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="test.jsonl not found"):
        preprocess_gsm8k(tmp_path, tmp_path / "out", splits=("test",))


# ---------------------------------------------------------------------------------------------- written as one set

def _raw(folder: Path, train: list[str], test: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(line + "\n" for line in train))
    (folder / "test.jsonl").write_text("".join(line + "\n" for line in test))
    return folder


def _good(n: int, tag: str = "") -> list[str]:
    return [json.dumps({"question": f"{tag}q{i}?", "answer": f"so {i}\n#### {i}"}) for i in range(n)]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_failed_preprocess_leaves_the_old_pair_intact(tmp_path, capsys):
    from megatron_ppo.data.manifest import MANIFEST_NAME

    out = tmp_path / "out"
    assert preprocess_gsm8k(_raw(tmp_path / "v1", _good(3), _good(2)), out) == {"train": 3, "test": 2}
    before = _snapshot(out)
    # v2: a different, valid train.jsonl and a test.jsonl with a bad line: nothing of v2 may land in `out`
    v2 = _raw(tmp_path / "v2", _good(5, "new"), [*_good(1), "{not json"])
    with pytest.raises(gsm8k.MalformedLineError, match=r"test\.jsonl:2: "):
        preprocess_gsm8k(v2, out)
    assert _snapshot(out) == before
    assert main(["gsm8k", "--input", str(v2), "--out", str(out)]) == 2
    assert "test.jsonl:2" in capsys.readouterr().err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "v1", "v2"]  # no temp dir left behind
    assert set(before) == {"train.parquet", "test.parquet", MANIFEST_NAME}


def test_manifest_names_the_pair_and_a_mixed_pair_is_refused_on_read(tmp_path):
    from megatron_ppo.data.manifest import MANIFEST_NAME, ManifestMismatchError, sha256_file
    from megatron_ppo.data.parquet_io import expand_parquet_paths, read_tables

    raw = _raw(tmp_path / "raw", _good(3), _good(2))
    preprocess_gsm8k(raw, tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())
    assert manifest["dataset"] == "gsm8k"
    assert manifest["sources"]["train.jsonl"]["sha256"] == sha256_file(raw / "train.jsonl")
    assert {n: e["rows"] for n, e in manifest["files"].items()} == {"train.parquet": 3, "test.parquet": 2}
    assert all(e["sha256"] == sha256_file(tmp_path / "a" / n) for n, e in manifest["files"].items())
    assert [t.num_rows for _, t in read_tables(expand_parquet_paths(tmp_path / "a"))] == [2, 3]  # test, train

    preprocess_gsm8k(_raw(tmp_path / "raw2", _good(4, "other"), _good(2)), tmp_path / "b")
    (tmp_path / "a" / "train.parquet").write_bytes((tmp_path / "b" / "train.parquet").read_bytes())
    with pytest.raises(ManifestMismatchError, match=r"a/train\.parquet: not the file .*test\.parquet"):
        read_tables(expand_parquet_paths(tmp_path / "a" / "train.parquet"))
    read_tables(expand_parquet_paths(tmp_path / "a" / "test.parquet"))  # the untouched file still reads


def test_a_crash_between_the_renames_is_detected_on_read(tmp_path, monkeypatch):
    """The manifest moves in first: stopped after train.parquet moved but before test.parquet did, the old
    test.parquet no longer matches the manifest and is refused."""
    from megatron_ppo.data import manifest as M
    from megatron_ppo.data.parquet_io import expand_parquet_paths, read_tables

    out = tmp_path / "out"
    preprocess_gsm8k(_raw(tmp_path / "v1", _good(3), _good(2)), out)
    real_replace = M.os.replace

    def replace(src, dst):
        if Path(dst).name == "test.parquet":
            raise OSError("simulated crash between renames")
        real_replace(src, dst)

    monkeypatch.setattr(M.os, "replace", replace)
    with pytest.raises(OSError, match="simulated"):
        preprocess_gsm8k(_raw(tmp_path / "v2", _good(5, "new"), _good(4, "new")), out)
    monkeypatch.undo()
    assert [t.num_rows for _, t in read_tables([out / "train.parquet"])] == [5]
    with pytest.raises(M.ManifestMismatchError, match=r"out/test\.parquet: not the file"):
        read_tables(expand_parquet_paths(out))
