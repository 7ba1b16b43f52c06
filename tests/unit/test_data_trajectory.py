"""Trajectory parquet: writer -> reader round trip, atomic per-step files, and every bad-input rule."""
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_ppo.data.schema import TRAJECTORY_FIELDS, SchemaError
from megatron_ppo.data.tokenizer import gsm8k_tokenizer
from megatron_ppo.data.trajectory import (
    TrajectoryDataset, TrajectoryError, TrajectoryWriter, trajectory_table, unpad, validate_trajectory_table,
)

PROMPTS = [[{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
           [{"role": "user", "content": "What is 6 times 7?"}],
           [{"role": "user", "content": "Half of 18?"}]]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return gsm8k_tokenizer(tmp_path_factory.getbasetemp() / "tokenizer-cache")


def _batch(tok, rng=np.random.default_rng(0)):
    responses = ["3 + 4 = 7\n#### 7", "6 * 7 = 42\n#### 42", "18 / 2 = 9\n#### 9"]
    ids = tok(responses, add_special_tokens=False)["input_ids"]
    return {
        "data_source": ["openai/gsm8k"] * 3,
        "prompt": PROMPTS,
        "reward_model": [{"style": "rule", "ground_truth": g} for g in ("7", "42", "9")],
        "extra_info": [{"split": "train", "index": i} for i in range(3)],
        "response": responses,
        "response_ids": [torch.tensor(x) for x in ids],
        "rollout_log_probs": [-rng.exponential(size=len(x)).astype(np.float32) for x in ids],
        "reward": [1.0, None, 0.0],
    }


def test_write_read_round_trip(tok, tmp_path):
    batch = _batch(tok)
    writer = TrajectoryWriter(tmp_path / "dump", policy_name="tiny-actor", temperature=1.0)
    path = writer.append(12, batch)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # readable as any file the user writes, not mkstemp's 0600
    assert path.name == "step_00000012.parquet"
    assert [p.name for p in (tmp_path / "dump").iterdir()] == ["step_00000012.parquet"]  # no temp files left
    schema = pq.read_schema(path)
    for name in ("response", "response_ids", "rollout_log_probs", "reward", "behaviour_policy"):
        assert schema.field(name).type == TRAJECTORY_FIELDS[name]
    ds = TrajectoryDataset(tmp_path / "dump", tokenizer=tok)
    assert len(ds) == 3 and ds.stats == {"rows_read": 3, "rows_kept": 3, "filtered_empty_response": 0}
    for i in range(3):
        item = ds[i]
        assert item["response_ids"] == batch["response_ids"][i].tolist()
        np.testing.assert_array_equal(item["rollout_log_probs"], batch["rollout_log_probs"][i])
        assert item["reward"] == batch["reward"][i] and item["raw_prompt"] == PROMPTS[i]
        assert item["behaviour_policy"] == {"name": "tiny-actor", "step": 12, "temperature": 1.0}
        expected = tok.apply_chat_template(PROMPTS[i], add_generation_prompt=True, tokenize=True)["input_ids"]
        assert item["prompt_ids"] == list(expected)  # no prompt_ids column: rebuilt from the chat template


def test_same_step_replaces_and_steps_accumulate(tok, tmp_path, caplog):
    writer = TrajectoryWriter(tmp_path)
    batch = _batch(tok)
    writer.append(1, batch)
    writer.append(2, batch)
    with caplog.at_level(logging.WARNING):
        writer.append(1, batch)
    assert "replacing it" in caplog.text
    assert len(TrajectoryDataset(tmp_path, tokenizer=tok)) == 6


def test_prompt_ids_and_padded_tensors(tmp_path):
    resp = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    logp = torch.tensor([[-0.1, -0.2, -0.3, 0.0], [-1.5, 0.0, 0.0, 0.0]])
    TrajectoryWriter(tmp_path).append(0, {
        "data_source": ["x", "x"], "prompt": PROMPTS[:2], "prompt_ids": [[1, 2], [1, 3, 4]],
        "response_ids": unpad(resp, mask), "rollout_log_probs": unpad(logp, mask)})
    ds = TrajectoryDataset(tmp_path)  # prompt_ids and response_ids stored: no tokenizer needed
    assert ds[0]["prompt_ids"] == [1, 2] and ds[0]["response_ids"] == [5, 6, 7] and ds[1]["response_ids"] == [8]
    np.testing.assert_allclose(ds[0]["rollout_log_probs"], [-0.1, -0.2, -0.3])
    assert ds[0]["reward"] is None and ds[0]["response"] is None


def _table(tok, **changes):
    batch = _batch(tok)
    batch.update(changes)
    return trajectory_table({k: v for k, v in batch.items() if v is not None})


def test_log_prob_count_must_match_tokens(tok, tmp_path):
    batch = _batch(tok)
    batch["rollout_log_probs"][1] = batch["rollout_log_probs"][1][:-1]
    n_ids = len(batch["response_ids"][1])
    with pytest.raises(TrajectoryError, match=rf"row 1: 'response_ids' has {n_ids} tokens but 'rollout_log_probs' "
                                              rf"has {n_ids - 1} values"):
        TrajectoryWriter(tmp_path).append(0, batch)
    assert list(tmp_path.iterdir()) == []  # nothing written
    pq.write_table(trajectory_table(batch), tmp_path / "bad.parquet")
    with pytest.raises(TrajectoryError, match=r"bad\.parquet: row 1: 'response_ids' has"):
        TrajectoryDataset(tmp_path)


@pytest.mark.parametrize("value,message", [(np.nan, "nan"), (0.5, "0.5"), (-np.inf, "-inf")])
def test_log_probs_finite_and_not_positive(tok, value, message):
    batch = _batch(tok)
    batch["rollout_log_probs"][2] = batch["rollout_log_probs"][2].copy()
    batch["rollout_log_probs"][2][3] = value
    with pytest.raises(TrajectoryError, match=rf"row 2: 'rollout_log_probs'\[3\] = .*{message}.* finite and <= 0"):
        validate_trajectory_table(trajectory_table(batch), "batch")


def test_nan_reward_is_an_error_null_is_fine(tok, tmp_path):
    with pytest.raises(TrajectoryError, match=r"f\.parquet: row 2: 'reward' = nan is not finite"):
        validate_trajectory_table(_table(tok, reward=[1.0, None, float("nan")]), "f.parquet")
    table, filtered = validate_trajectory_table(_table(tok, reward=[None, None, None]), "f.parquet")
    assert filtered == 0 and table.num_rows == 3


def test_empty_response_filtered_and_counted_or_error(tok, tmp_path, caplog):
    batch = _batch(tok)
    batch["response"][1], batch["response_ids"][1], batch["rollout_log_probs"][1] = "", [], np.zeros(0, np.float32)
    pq.write_table(trajectory_table(batch), tmp_path / "t.parquet")
    with caplog.at_level(logging.WARNING):
        ds = TrajectoryDataset(tmp_path, tokenizer=tok)
    assert len(ds) == 2 and ds.stats["filtered_empty_response"] == 1 and ds.stats["rows_read"] == 3
    assert "filtered 1 trajectory row(s) with an empty response (rows [1])" in caplog.text
    assert [ds[i]["reward_model"]["ground_truth"] for i in range(2)] == ["7", "9"]
    with pytest.raises(TrajectoryError, match=r"t\.parquet: row 1: empty response"):
        TrajectoryDataset(tmp_path, tokenizer=tok, empty_response_policy="error")
    with pytest.raises(TrajectoryError, match=r"step 3\).*row 1: empty response"):
        TrajectoryWriter(tmp_path / "w").append(3, batch)  # the writer never stores an empty response


def test_missing_columns_named(tok, tmp_path):
    with pytest.raises(SchemaError, match=r"missing required column\(s\) \['rollout_log_probs'\]"):
        validate_trajectory_table(_table(tok, rollout_log_probs=None), "f")
    with pytest.raises(SchemaError, match=r"missing required column\(s\) \['prompt'\]"):
        validate_trajectory_table(_table(tok, prompt=None), "f")
    with pytest.raises(SchemaError, match="needs column 'response_ids' or 'response'"):
        validate_trajectory_table(_table(tok, response=None, response_ids=None), "f")
    table = _table(tok).drop(["reward", "extra_info", "reward_model"])  # optional columns may be absent
    assert validate_trajectory_table(table, "f")[0].num_rows == 3
    bad_type = _table(tok).set_column(6, "rollout_log_probs", pa.array(["a", "b", "c"]))
    with pytest.raises(SchemaError, match="column 'rollout_log_probs' has type string"):
        validate_trajectory_table(bad_type, "f")


def test_text_only_response_is_tokenised_and_checked(tok, tmp_path):
    batch = _batch(tok)
    del batch["response_ids"]
    pq.write_table(trajectory_table(batch), tmp_path / "text.parquet")
    ds = TrajectoryDataset(tmp_path, tokenizer=tok)
    assert ds[0]["response_ids"] == tok(batch["response"][0], add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="no 'prompt_ids' column, so a tokenizer is needed"):
        TrajectoryDataset(tmp_path)
    batch["response"][0] += " extra words"
    pq.write_table(trajectory_table(batch), tmp_path / "text.parquet")
    with pytest.raises(TrajectoryError, match=r"row 0: 'response' tokenises to \d+ tokens but 'rollout_log_probs'"):
        TrajectoryDataset(tmp_path, tokenizer=tok)


def test_writer_rejects_malformed_batches(tok, tmp_path):
    writer = TrajectoryWriter(tmp_path)
    with pytest.raises(TrajectoryError, match="unknown column 'values'"):
        writer.append(0, {**_batch(tok), "values": [1, 2, 3]})
    with pytest.raises(TrajectoryError, match="different row counts"):
        writer.append(0, {**_batch(tok), "reward": [1.0]})
    with pytest.raises(TrajectoryError, match="must hold integer token ids"):
        writer.append(0, {**_batch(tok), "response_ids": [np.ones(len(x)) * 0.5 for x in _batch(tok)["response_ids"]]})
    with pytest.raises(TrajectoryError, match="1-D per row"):
        writer.append(0, {**_batch(tok), "response_ids": [torch.ones(2, 2, dtype=torch.long)] * 3})
    assert list(tmp_path.iterdir()) == []


def test_items_name_their_file_row_after_filtering_and_the_writers_tokenizer(tok, tmp_path):
    """Each item's `source` is its row in the file (row 2 stays row 2 when row 1 was dropped); the writer's
    tokenizer fingerprint is stored in the parquet metadata and read back per item; without a tokenizer, none."""
    from megatron_ppo.data.trajectory import TOKENIZER_METADATA, tokenizer_fingerprint

    batch = _batch(tok)
    batch["response"][1], batch["response_ids"][1], batch["rollout_log_probs"][1] = "", [], np.zeros(0, np.float32)
    pq.write_table(trajectory_table(batch), tmp_path / "t.parquet")
    ds = TrajectoryDataset(tmp_path / "t.parquet", tokenizer=tok)
    assert [it["source"] for it in ds.items] == [f"{tmp_path / 't.parquet'}: row 0", f"{tmp_path / 't.parquet'}: row 2"]
    assert all(it["tokenizer"] is None for it in ds.items)

    good = _batch(tok)
    path = TrajectoryWriter(tmp_path / "w", tokenizer=tok).append(1, good)
    fingerprint = tokenizer_fingerprint(tok)
    assert len(fingerprint) == 64
    assert pq.read_schema(path).metadata[TOKENIZER_METADATA] == fingerprint.encode()
    assert {it["tokenizer"] for it in TrajectoryDataset(path, tokenizer=tok).items} == {fingerprint}
    other = gsm8k_tokenizer(tmp_path / "other", vocab_size=300)
    assert tokenizer_fingerprint(other) != fingerprint
