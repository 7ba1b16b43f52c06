"""verl 0.9.1 interop: verl's RLHFDataset reads our parquet, and we read parquet written the way verl writes it."""
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from megatron_ppo.data import gsm8k  # noqa: E402
from megatron_ppo.data.preprocess import preprocess_gsm8k  # noqa: E402
from megatron_ppo.data.prompt_dataset import PromptDataset  # noqa: E402
from megatron_ppo.data.tokenizer import gsm8k_tokenizer  # noqa: E402

RAW = gsm8k.default_gsm8k_dir()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return gsm8k_tokenizer(tmp_path_factory.getbasetemp() / "tokenizer-cache")


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    out = tmp_path_factory.mktemp("ours")
    preprocess_gsm8k(RAW, out, splits=("test",))
    return out / "test.parquet"


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    return tmp_path


def test_verl_rlhf_dataset_reads_our_parquet(tok, ours, hf_cache):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    full = PromptDataset(ours, tok, max_prompt_length=4096)
    limit = int(np.percentile(full.lengths, 70))  # so both sides filter the same ~30% of prompts
    config = OmegaConf.create({"cache_dir": str(hf_cache / "verl"), "max_prompt_length": limit,
                               "filter_overlong_prompts": True, "filter_overlong_prompts_workers": 1})
    theirs = RLHFDataset(data_files=str(ours), tokenizer=tok, config=config)
    mine = PromptDataset(ours, tok, max_prompt_length=limit, overlong_prompt_policy="filter")
    assert 0 < mine.stats["filtered_overlong"] < 1319 and len(theirs) == len(mine)
    for i in range(len(mine)):
        row = theirs[i]
        assert row["index"] == mine[i]["index"]
        assert row["raw_prompt"] == mine[i]["raw_prompt"] and row["data_source"] == mine[i]["data_source"]
        assert row["reward_model"] == mine[i]["reward_model"] and row["extra_info"] == mine[i]["extra_info"]
    # verl tokenises with apply_chat_template(tokenize=True); our ids are the same tokens
    reference = tok.apply_chat_template(theirs[5]["raw_prompt"], add_generation_prompt=True, tokenize=True)
    assert list(reference["input_ids"]) == mine[5]["input_ids"]


def _verl_process_fn(split):
    """The map function of verl's examples/data_preprocess/gsm8k.py. The examples/ folder is not in verl's wheel, so
    the map's record layout is transcribed; the ground truth comes from verl's own installed code
    (``verl.utils.reward_score.gsm8k.extract_solution``, strict: the last ``#### N``, commas removed), not a copy."""
    from verl.utils.reward_score.gsm8k import extract_solution as verl_extract

    def extract_solution(solution_str):
        solution = verl_extract(solution_str, method="strict")
        assert solution is not None
        return solution

    def process_fn(example, idx):
        question_raw = example.pop("question")
        question = question_raw + " " + 'Let\'s think step by step and output the final answer after "####".'
        answer_raw = example.pop("answer")
        solution = extract_solution(answer_raw)
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw},
        }

    return process_fn


def test_we_read_parquet_written_by_verls_recipe(tok, ours, tmp_path, hf_cache):
    import datasets

    records = [json.loads(line) for line in open(RAW / "test.jsonl", encoding="utf-8")]
    verl_file = tmp_path / "verl_test.parquet"
    datasets.Dataset.from_list(records).map(_verl_process_fn("test"), with_indices=True).to_parquet(str(verl_file))
    theirs = PromptDataset(verl_file, tok, max_prompt_length=4096)
    mine = PromptDataset(ours, tok, max_prompt_length=4096)
    assert len(theirs) == len(mine) == 1319
    for i in range(1319):
        a, b = theirs[i], mine[i]
        assert a["input_ids"] == b["input_ids"]
        for key in ("raw_prompt", "data_source", "ability", "reward_model", "extra_info", "index"):
            assert a[key] == b[key], (i, key)
    # same rows, same types: the files differ only in datasets' metadata and any extra columns it keeps
    verl_table = pq.read_table(verl_file)
    our_table = pq.read_table(ours)
    for name in our_table.column_names:
        assert verl_table.schema.field(name).type == our_table.schema.field(name).type, name
        assert verl_table[name].to_pylist() == our_table[name].to_pylist(), name
