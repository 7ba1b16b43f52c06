"""Prompt dataset on real GSM8K parquet: chat-templated ids, over-long policies, schema errors, collation."""
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_ppo.data.gsm8k import default_gsm8k_dir
from megatron_ppo.data.preprocess import preprocess_gsm8k
from megatron_ppo.data.prompt_dataset import (
    PromptDataset, PromptTooLongError, collate_prompts, overlong_policy_from_verl,
)
from megatron_ppo.data.schema import SchemaError
from megatron_ppo.data.tokenizer import gsm8k_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return gsm8k_tokenizer(tmp_path_factory.getbasetemp() / "tokenizer-cache")


@pytest.fixture(scope="module")
def test_parquet(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k-test")
    preprocess_gsm8k(default_gsm8k_dir(), out, splits=("test",))
    return out / "test.parquet"


@pytest.fixture(scope="module")
def full(tok, test_parquet):
    return PromptDataset(test_parquet, tok, max_prompt_length=4096)


def test_reads_all_rows_with_chat_template_ids(tok, full):
    assert len(full) == 1319 and full.stats == {"rows_read": 1319, "rows_kept": 1319, "filtered_overlong": 0,
                                                "truncated": 0}
    for i in (0, 1, 657, 1318):
        item = full[i]
        reference = tok.apply_chat_template(item["raw_prompt"], add_generation_prompt=True, tokenize=True)
        assert item["input_ids"] == list(reference["input_ids"])
        assert item["index"] == i and item["extra_info"]["index"] == i and item["data_source"] == "openai/gsm8k"
        assert tok.decode(item["input_ids"]).endswith("<|im_start|>assistant\n")
    assert full.lengths.tolist() == [len(full[i]["input_ids"]) for i in range(len(full))]


def _limit(full):
    return int(np.percentile(full.lengths, 80))


def test_overlong_error_names_file_row_and_length(tok, test_parquet, full):
    limit = _limit(full)
    first = int(np.flatnonzero(full.lengths > limit)[0])
    with pytest.raises(PromptTooLongError, match=rf"test\.parquet: row {first}: prompt has "
                                                 rf"{full.lengths[first]} tokens > max_prompt_length={limit}"):
        PromptDataset(test_parquet, tok, max_prompt_length=limit)


def test_overlong_filter_counts_and_logs(tok, test_parquet, full, caplog):
    limit = _limit(full)
    keep = np.flatnonzero(full.lengths <= limit)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(test_parquet, tok, max_prompt_length=limit, overlong_prompt_policy="filter")
    n_filtered = 1319 - keep.size
    assert n_filtered > 0 and ds.stats["filtered_overlong"] == n_filtered and len(ds) == keep.size
    assert f"filtered {n_filtered} of 1319 prompts" in caplog.text
    assert [ds[j]["index"] for j in range(len(ds))] == keep.tolist()


@pytest.mark.parametrize("policy", ["truncate_left", "truncate_right"])
def test_overlong_truncation(tok, test_parquet, full, policy):
    limit = _limit(full)
    ds = PromptDataset(test_parquet, tok, max_prompt_length=limit, overlong_prompt_policy=policy)
    assert len(ds) == 1319 and ds.stats["truncated"] == int((full.lengths > limit).sum())
    for i in range(1319):
        ids, whole = ds[i]["input_ids"], full[i]["input_ids"]
        assert len(ids) == min(limit, len(whole))
        assert ids == (whole[-limit:] if policy == "truncate_left" else whole[:limit])


def test_verl_keys_map_to_policies():
    assert overlong_policy_from_verl(True, "error") == "filter"
    assert overlong_policy_from_verl(False, "error") == "error"
    assert overlong_policy_from_verl(False, "left") == "truncate_left"
    assert overlong_policy_from_verl(False, "right") == "truncate_right"
    with pytest.raises(ValueError, match="data.truncation='middle'"):
        overlong_policy_from_verl(False, "middle")


def _write(path, columns):
    pq.write_table(pa.table(columns), path)
    return path


MESSAGES = [[{"role": "user", "content": "How many legs do 3 cats have?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]]


def test_any_data_source_several_files_no_extra_columns(tok, tmp_path):
    a = _write(tmp_path / "a.parquet", {"data_source": ["mine/cats"], "prompt": [MESSAGES[0]]})
    b = _write(tmp_path / "b.parquet", {"data_source": ["mine/sums"], "prompt": [MESSAGES[1]], "other": [1]})
    ds = PromptDataset([a, b], tok, max_prompt_length=64)
    assert [ds[i]["data_source"] for i in range(2)] == ["mine/cats", "mine/sums"]
    assert [ds[i]["index"] for i in range(2)] == [0, 1]  # no extra_info.index: position among all rows
    assert ds[1]["reward_model"] is None and ds[1]["extra_info"] is None
    assert tok.decode(ds[1]["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert len(PromptDataset(tmp_path, tok, max_prompt_length=64)) == 2  # a directory means its parquet files
    first = PromptDataset([a, b], tok, max_prompt_length=64, max_samples=1)
    assert len(first) == 1 and first[0]["data_source"] == "mine/cats" and first.stats["rows_read"] == 1


def test_bad_files(tok, tmp_path):
    no_prompt = _write(tmp_path / "no_prompt.parquet", {"data_source": ["x"], "question": ["hi"]})
    with pytest.raises(SchemaError, match=r"no_prompt\.parquet: missing required column\(s\) \['prompt'\]"):
        PromptDataset(no_prompt, tok, max_prompt_length=64)
    string_prompt = _write(tmp_path / "str.parquet", {"data_source": ["x"], "prompt": ["hi"]})
    with pytest.raises(SchemaError, match=r"str\.parquet: column 'prompt' has type string; expected a list"):
        PromptDataset(string_prompt, tok, max_prompt_length=64)
    empty = _write(tmp_path / "empty.parquet", {"data_source": ["x", "x"], "prompt": [MESSAGES[0], []]})
    with pytest.raises(SchemaError, match=r"empty\.parquet: row 1: column 'prompt' is empty"):
        PromptDataset(empty, tok, max_prompt_length=64)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: cannot read as parquet"):
        PromptDataset(tmp_path / "junk.parquet", tok, max_prompt_length=64)
    with pytest.raises(FileNotFoundError, match="nope.parquet does not exist"):
        PromptDataset(tmp_path / "nope.parquet", tok, max_prompt_length=64)
    with pytest.raises(ValueError, match="overlong_prompt_policy='drop'"):
        PromptDataset(no_prompt, tok, max_prompt_length=64, overlong_prompt_policy="drop")


def test_collate_left_pads(full, tok):
    batch = full.collate([3, 0, 7])
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    width = max(len(full[i]["input_ids"]) for i in (3, 0, 7))
    assert ids.shape == mask.shape == pos.shape == (3, width)
    for row, i in enumerate((3, 0, 7)):
        n = len(full[i]["input_ids"])
        assert ids[row, width - n:].tolist() == full[i]["input_ids"]
        assert (ids[row, :width - n] == tok.pad_token_id).all() and mask[row].sum() == n
        assert pos[row, width - n:].tolist() == list(range(n))
    assert batch["index"] == [3, 0, 7] and len(batch["reward_model"]) == 3
    assert collate_prompts([{"input_ids": [5]}], pad_token_id=0)["input_ids"].tolist() == [[5]]
