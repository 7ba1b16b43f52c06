"""Tokenizers: any HF tokenizer directory; for tests and the embedded default, a small byte-level BPE built from
GSM8K text with the `tokenizers` library and saved as an HF tokenizer directory (so there is one code path).

Nothing is downloaded. The built tokenizer is cached under a folder the caller gives, keyed by the training text's
sha256, the vocab size and the builder version, and written atomically (temp dir, then rename).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 4096
BUILDER_VERSION = 1
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
# ChatML, as Qwen models use: the assistant turn ends with <|im_end|>, which is also the EOS token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_tokenizer(path: str | Path):
    """An HF tokenizer from a local directory (never the hub); it must have a chat template and a pad token."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer: {path} is not a directory (expected an HF tokenizer directory)")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer: {path} has no chat template; prompts are chat messages and need one")
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ValueError(f"tokenizer: {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
        log.info("tokenizer %s: no pad token, using eos %r for padding", path, tok.eos_token)
    return tok


def _gsm8k_texts(train_jsonl: Path) -> list[str]:
    texts = []
    with open(train_jsonl, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            texts += [record["question"], record["answer"]]
    return texts


def build_gsm8k_tokenizer(train_jsonl: str | Path, out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE on GSM8K train questions+answers and save it as an HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} specials")
    tok = Tokenizer(models.BPE())
    # Digits one by one (as Qwen/Llama-3 do: numbers tokenise consistently), then GPT-2 byte-level splitting.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_gsm8k_texts(Path(train_jsonl)), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    hf.save_pretrained(str(out_dir))
    return Path(out_dir)


def gsm8k_tokenizer_dir(cache_dir: str | Path, gsm8k_dir: str | Path | None = None,
                        vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """The cached tokenizer directory for these inputs, building it (a few seconds) on a cache miss."""
    from megatron_ppo.data.gsm8k import default_gsm8k_dir

    train = Path(gsm8k_dir or default_gsm8k_dir()) / "train.jsonl"
    if not train.is_file():
        raise FileNotFoundError(f"tokenizer: GSM8K training text {train} not found")
    digest = hashlib.sha256(train.read_bytes()).hexdigest()[:16]
    final = Path(cache_dir) / f"gsm8k-bpe-v{BUILDER_VERSION}-{vocab_size}-{digest}"
    if (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build_gsm8k_tokenizer(train, tmp, vocab_size)
        try:
            os.rename(tmp, final)
            log.info("tokenizer: built %s", final)
        except OSError:  # another process finished the same build first; both are identical
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def gsm8k_tokenizer(cache_dir: str | Path, gsm8k_dir: str | Path | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The project's small GSM8K tokenizer, loaded through the same path as any HF tokenizer directory."""
    return load_tokenizer(gsm8k_tokenizer_dir(cache_dir, gsm8k_dir, vocab_size))


def stop_token_ids(tokenizer, model_path: str | Path | None = None) -> list[int]:
    """The token ids that end a response: the tokenizer's eos, and those of the model's generation_config.json
    (an int or a list, as HF generate and vLLM read it), in that order, without repeats."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = Path(model_path) / "generation_config.json" if model_path else None
    if config is not None and config.is_file():
        try:
            value = json.loads(config.read_text()).get("eos_token_id")
        except ValueError as exc:
            raise ValueError(f"{config}: not valid JSON ({exc})") from exc
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids
