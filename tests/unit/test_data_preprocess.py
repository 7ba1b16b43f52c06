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
