"""The GSM8K byte-level BPE tokenizer: built locally, cached, loaded as an HF tokenizer directory, lossless."""
import json

import pytest

from megatron_ppo.data.gsm8k import default_gsm8k_dir
from megatron_ppo.data.tokenizer import (
    CHAT_TEMPLATE, DEFAULT_VOCAB_SIZE, EOS_TOKEN, PAD_TOKEN, build_gsm8k_tokenizer, gsm8k_tokenizer_dir,
    load_tokenizer,
)

RAW = default_gsm8k_dir()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return gsm8k_tokenizer_dir(tmp_path_factory.getbasetemp() / "tokenizer-cache")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_loads_as_hf_tokenizer_with_chat_template(tok):
    from transformers import PreTrainedTokenizerBase

    assert isinstance(tok, PreTrainedTokenizerBase)
    assert len(tok) == DEFAULT_VOCAB_SIZE
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2  # specials stay single tokens
    assert ids.count(tok.eos_token_id) == 1


def _texts(splits):
    texts = []
    for split in splits:
        for line in open(RAW / f"{split}.jsonl", encoding="utf-8"):
            record = json.loads(line)
            texts += [record["question"], record["answer"]]
    return texts


@pytest.mark.slow
def test_lossless_on_all_gsm8k_text(tok):
    texts = _texts(("train", "test"))
    assert len(texts) == 2 * (7473 + 1319)
    decoded = tok.backend_tokenizer.decode_batch(tok(texts, add_special_tokens=False)["input_ids"],
                                                 skip_special_tokens=False)
    assert [i for i, (a, b) in enumerate(zip(texts, decoded)) if a != b] == []


def test_lossless_on_test_split_and_digits_split(tok):
    texts = _texts(("test",))
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    decoded = tok.batch_decode(encoded, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert [i for i, (a, b) in enumerate(zip(texts, decoded)) if a != b] == []
    assert tok.convert_ids_to_tokens(tok("12345", add_special_tokens=False)["input_ids"]) == list("12345")
    # unseen bytes still round-trip (byte-level): emoji, CJK, control characters
    odd = "∑ 数学 🙂 \t\x00 é"
    assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd


def test_cache_hit_does_not_rebuild(tok_dir, tmp_path_factory):
    stamp = (tok_dir / "tokenizer.json").stat().st_mtime_ns
    again = gsm8k_tokenizer_dir(tmp_path_factory.getbasetemp() / "tokenizer-cache")
    assert again == tok_dir and (again / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tok_dir.parent.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_build_is_deterministic(tmp_path):
    lines = open(RAW / "train.jsonl", encoding="utf-8").readlines()[:500]
    (tmp_path / "train.jsonl").write_text("".join(lines), encoding="utf-8")
    a = build_gsm8k_tokenizer(tmp_path / "train.jsonl", tmp_path / "a", vocab_size=600)
    b = build_gsm8k_tokenizer(tmp_path / "train.jsonl", tmp_path / "b", vocab_size=600)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_bad_inputs(tmp_path, tok_dir):
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_gsm8k_tokenizer(RAW / "train.jsonl", tmp_path / "x", vocab_size=100)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="train.jsonl not found"):
        gsm8k_tokenizer_dir(tmp_path / "cache", gsm8k_dir=tmp_path)
    no_template = tmp_path / "no_template"
    no_template.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_template / name).write_text((tok_dir / name).read_text())
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(no_template)


def test_template_constant_is_what_is_saved(tok_dir):
    assert (tok_dir / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_stop_tokens_are_the_tokenizers_eos_and_the_generation_configs(tmp_path):
    """A model whose generation_config.json lists several eos ids (Llama-3-Instruct: <|eot_id|> and
    <|end_of_text|>) stops on each of them, as HF generate and vLLM do; the tokenizer's eos comes first."""
    import json
    from types import SimpleNamespace

    from megatron_ppo.data.tokenizer import stop_token_ids

    tok = SimpleNamespace(eos_token_id=7)
    assert stop_token_ids(tok, None) == [7]
    assert stop_token_ids(tok, tmp_path) == [7]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 12]}))
    assert stop_token_ids(tok, tmp_path) == [7, 9, 12]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), tmp_path) == [3]
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json"):
        stop_token_ids(tok, tmp_path)
