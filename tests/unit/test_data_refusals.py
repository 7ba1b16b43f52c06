"""Negative tests for data-validation refusals no other test made fire (issue 11 item 2): each one goes through the
public function a user or the trainer calls, on real parquet / jsonl / tokenizer files, and matches the part of the
message that names the file, row, column or key."""
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_ppo.data.dynamic_batch import balance_across_ranks, plan_micro_batches, restore_order
from megatron_ppo.data.manifest import MANIFEST_NAME, ManifestMismatchError
from megatron_ppo.data.preprocess import main as preprocess_main
from megatron_ppo.data.preprocess import preprocess_arithmetic
from megatron_ppo.data.prompt_dataset import PromptDataset
from megatron_ppo.data.sampler import StatefulSampler
from megatron_ppo.data.schema import TRAJECTORY_FIELDS
from megatron_ppo.data.tokenizer import gsm8k_tokenizer_dir, load_tokenizer
from megatron_ppo.data.trajectory import TrajectoryDataset, TrajectoryError

PROMPT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """The project's GSM8K tokenizer directory (the cache path other data tests share)."""
    return gsm8k_tokenizer_dir(tmp_path_factory.getbasetemp() / "tokenizer-cache")


def _trajectory_file(path, response_ids, log_probs, prompt_ids=None):
    n = len(log_probs)
    cols = {
        "data_source": pa.array(["x"] * n),
        "prompt": pa.array([PROMPT] * n),
        "prompt_ids": pa.array(prompt_ids if prompt_ids is not None else [[1, 2, 3]] * n,
                               TRAJECTORY_FIELDS["prompt_ids"]),
        "response_ids": pa.array(response_ids, TRAJECTORY_FIELDS["response_ids"]),
        "rollout_log_probs": pa.array(log_probs, TRAJECTORY_FIELDS["rollout_log_probs"]),
    }
    pq.write_table(pa.table(cols), path)
    return path


# --- dynamic_batch -------------------------------------------------------------------------------------------------

def test_balance_across_zero_ranks_refused():
    with pytest.raises(ValueError, match=r"k=0 partitions must be >= 1"):
        balance_across_ranks([5, 6, 7], dp_size=0)


def test_unknown_balance_mode_refused():
    with pytest.raises(ValueError, match=r"balance='size'; choose 'workload' or 'tokens'"):
        plan_micro_batches([[5, 6]], 100, balance="size")


def test_restore_order_count_mismatch_refused():
    plan = plan_micro_batches([[5, 6, 7]], 100)[0]
    with pytest.raises(ValueError, match=r"2 values for 3 indexed samples"):
        restore_order(torch.zeros(2), plan)


# --- sampler -------------------------------------------------------------------------------------------------------

def test_sampler_zero_batch_size_refused():
    with pytest.raises(ValueError, match=r"batch_size=0 must be >= 1"):
        StatefulSampler(num_rows=10, batch_size=0)


# --- preprocessing and manifests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("split,flag", [("train", "--train-rows"), ("test", "--test-rows")])
def test_arithmetic_zero_rows_refused(tmp_path, capsys, split, flag):
    with pytest.raises(ValueError, match=rf"arithmetic: {split} rows must be >= 1, got 0"):
        preprocess_arithmetic(tmp_path / "out", **{f"{split}_rows": 0})
    assert not (tmp_path / "out").exists()
    assert preprocess_main(["arithmetic", "--out", str(tmp_path / "out"), flag, "0"]) == 2
    assert f"{split} rows must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("manifest_text", ["{not json", "[1, 2]", json.dumps({"format": "megatron_ppo.preprocess/1"})])
def test_unreadable_manifest_names_it(tmp_path, tok_dir, manifest_text):
    out = tmp_path / "arith"
    preprocess_arithmetic(out, train_rows=4, test_rows=2)
    (out / MANIFEST_NAME).write_text(manifest_text)
    with pytest.raises(ManifestMismatchError, match=rf"arith/{MANIFEST_NAME}: unreadable manifest"):
        PromptDataset(out / "train.parquet", load_tokenizer(tok_dir), max_prompt_length=256)


def test_empty_file_list_refused(tok_dir):
    with pytest.raises(ValueError, match=r"data_files: no files given"):
        PromptDataset([], load_tokenizer(tok_dir), max_prompt_length=256)


# --- tokenizer -----------------------------------------------------------------------------------------------------

def test_tokenizer_without_pad_or_eos_refused(tmp_path, tok_dir):
    bare = tmp_path / "bare_tok"
    shutil.copytree(tok_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    for key in ("pad_token", "eos_token"):
        config.pop(key, None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    special = bare / "special_tokens_map.json"
    if special.exists():
        special.unlink()
    with pytest.raises(ValueError, match=r"bare_tok has neither a pad nor an eos token"):
        load_tokenizer(bare)


# --- trajectory parquet --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("column", ["rollout_log_probs", "response_ids", "prompt_ids"])
def test_trajectory_null_list_names_file_row_column(tmp_path, column):
    resp, logp, prompt = [[4, 5], [6, 7]], [[-0.1, -0.2], [-0.3, -0.4]], [[1, 2], [1, 3]]
    {"rollout_log_probs": logp, "response_ids": resp, "prompt_ids": prompt}[column][1] = None
    path = _trajectory_file(tmp_path / "nulls.parquet", resp, logp, prompt)
    with pytest.raises(TrajectoryError, match=rf"nulls\.parquet: row 1: column '{column}' is null"):
        TrajectoryDataset(path)


def test_trajectory_nothing_left_refused(tmp_path):
    path = _trajectory_file(tmp_path / "all_empty.parquet", [[], []], [[], []])
    with pytest.raises(ValueError, match=r"all_empty\.parquet.*: no trajectory rows left .*"
                                         r"'filtered_empty_response': 2"):
        TrajectoryDataset(path)
    assert len(TrajectoryDataset(_trajectory_file(tmp_path / "ok.parquet", [[4]], [[-np.log(2)]]))) == 1


def test_multi_level_arithmetic_is_held_out_and_correct(tmp_path):
    """The learning benchmark's task for a pretrained model: the MULTI_OPS mix, answers right, test questions
    distinct and from the held-out pool (the same for every seed), no train row from it; the single level (the tiny
    default's data) is unchanged by the level option."""
    import pyarrow.parquet as pq

    from megatron_ppo.data import arithmetic

    counts = preprocess_arithmetic(tmp_path / "m", 600, 256, seed=3, level="multi")
    assert counts == {"train": 600, "test": 256}
    train = pq.read_table(tmp_path / "m" / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "m" / "test.parquet").to_pylist()
    test_q = [r["extra_info"]["question"] for r in test]
    assert len(set(test_q)) == 256 and all(arithmetic.in_test_pool(q) for q in test_q)
    other_seed = {r["extra_info"]["question"] for r in arithmetic.rows("train", 2000, 4, "multi")}
    assert not ({r["extra_info"]["question"] for r in train} | other_seed) & set(test_q)
    kinds = set()
    for r in train + test:
        a, op, b = r["extra_info"]["question"].removeprefix("What is ").removesuffix("?").split()
        kinds.add((op, len(a), len(b)))
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert r["reward_model"]["ground_truth"] == str(want) and want >= 0
    assert {op for op, *_ in kinds} == {"+", "-", "*"} and len(kinds) == 6  # every kind of MULTI_OPS drawn
    pool = arithmetic.test_pool_size()
    assert 0.2 < pool / len(arithmetic.multi_questions()) < 0.3
    with pytest.raises(ValueError, match="test pool holds"):
        preprocess_arithmetic(tmp_path / "x", 10, pool + 1, level="multi")
    # the single level's rows as the code before the level option wrote them (the tiny default's cached data)
    assert [r["extra_info"]["answer"] for r in arithmetic.rows("train", 3, 0)] == [
        "0 + 5 = 5\n#### 5", "7 + 2 = 9\n#### 9", "6 + 3 = 9\n#### 9"]
