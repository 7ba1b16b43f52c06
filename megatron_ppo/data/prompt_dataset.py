"""Prompt dataset: verl-schema parquet (any data_source) -> chat-templated prompt token ids.

Over-long prompts follow an explicit policy (`overlong_prompt_policy`):
  "error"           raise, naming the file, row and length (the default: nothing is dropped silently)
  "filter"          drop them; the count is logged and kept in `stats["filtered_overlong"]`
  "truncate_left"   keep the last `max_prompt_length` tokens;  counted in `stats["truncated"]`
  "truncate_right"  keep the first `max_prompt_length` tokens; counted in `stats["truncated"]`
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa

from megatron_ppo.data.parquet_io import expand_parquet_paths, read_tables
from megatron_ppo.data.schema import PROMPT_REQUIRED, SchemaError, check_prompt_column, require_columns
from megatron_ppo.errors import UsageError

log = logging.getLogger(__name__)

OVERLONG_POLICIES = ("error", "filter", "truncate_left", "truncate_right")


def overlong_policy_from_verl(filter_overlong_prompts: bool, truncation: str = "error") -> str:
    """verl's two keys (data.filter_overlong_prompts, data.truncation = error|left|right) -> one policy name."""
    if filter_overlong_prompts:
        return "filter"
    policies = {"error": "error", "left": "truncate_left", "right": "truncate_right"}
    if truncation not in policies:
        raise ValueError(f"data.truncation={truncation!r}; choose one of {sorted(policies)}")
    return policies[truncation]


class PromptTooLongError(UsageError):
    """A prompt is longer than max_prompt_length under overlong_prompt_policy="error"."""


def chat_prompt_ids(tokenizer, conversations: Sequence[list[dict]]) -> list[list[int]]:
    """Token ids of each conversation rendered with the chat template and the generation prompt appended.

    Renders to text and encodes the batch in one call (the Rust tokenizer's fast path); this equals
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` token for token.
    """
    texts = [tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False) for c in conversations]
    return encode_texts(tokenizer, texts)


def encode_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids without added special tokens; straight through the Rust tokenizer when there is one
    (skipping the HF wrapper's per-row bookkeeping makes this faster; throughput: docs/bench/data.md)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


class PromptDataset:
    """Rows of one or more prompt parquet files, tokenised once at construction.

    Item i is a dict: `input_ids` (list[int]), `raw_prompt` (the chat messages), `data_source`, `reward_model`,
    `extra_info`, `ability` (None where the file has no such column), and `index`
    (extra_info["index"] when present, else the row's position among all files read).
    """

    def __init__(
        self,
        data_files: str | Path | Iterable[str | Path],
        tokenizer,
        max_prompt_length: int,
        overlong_prompt_policy: str = "error",
        prompt_key: str = "prompt",
        max_samples: int = -1,
    ):
        """max_samples > 0 reads only the first max_samples rows of the files, in order (verl's
        data.train_max_samples); the over-long policy then applies to those."""
        if overlong_prompt_policy not in OVERLONG_POLICIES:
            raise ValueError(f"overlong_prompt_policy={overlong_prompt_policy!r}; choose one of {OVERLONG_POLICIES}")
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length} must be >= 1")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.policy = overlong_prompt_policy
        self.prompt_key = prompt_key
        self.rows: list[dict] = []
        self.input_ids: list[list[int]] = []
        self.stats = {"rows_read": 0, "rows_kept": 0, "filtered_overlong": 0, "truncated": 0}
        budget = max_samples if max_samples > 0 else None
        for path, table in read_tables(expand_parquet_paths(data_files)):
            if budget is not None:
                if budget == 0:
                    break
                table, budget = table.slice(0, budget), budget - min(budget, table.num_rows)
            self._add_file(path, table)
        if not self.rows:
            raise ValueError(f"data files {data_files}: no rows left ({self.stats['rows_read']} read, "
                             f"{self.stats['filtered_overlong']} longer than data.max_prompt_length="
                             f"{max_prompt_length} filtered by data.filter_overlong_prompts)")
        self.lengths = np.array([len(ids) for ids in self.input_ids], dtype=np.int64)

    def _add_file(self, path: Path, table: pa.Table) -> None:
        required = tuple(self.prompt_key if c == "prompt" else c for c in PROMPT_REQUIRED)
        require_columns(table.schema, required, str(path), "prompt parquet")
        check_prompt_column(table.schema, str(path), self.prompt_key)
        rows = table.to_pylist()
        for r, row in enumerate(rows):
            if not row[self.prompt_key]:
                raise SchemaError(f"{path}: row {r}: column {self.prompt_key!r} is empty (no chat messages)")
        ids = chat_prompt_ids(self.tokenizer, [row[self.prompt_key] for row in rows])
        n_filtered = n_truncated = 0
        for r, (row, tokens) in enumerate(zip(rows, ids)):
            if len(tokens) > self.max_prompt_length:
                if self.policy == "error":
                    raise PromptTooLongError(
                        f"{path}: row {r}: prompt has {len(tokens)} tokens > max_prompt_length="
                        f"{self.max_prompt_length} (data.max_prompt_length): raise it, or set "
                        "data.filter_overlong_prompts=true (drop such prompts) or data.truncation=left|right"
                    )
                if self.policy == "filter":
                    n_filtered += 1
                    continue
                n_truncated += 1
                m = self.max_prompt_length
                tokens = tokens[-m:] if self.policy == "truncate_left" else tokens[:m]
            extra = row.get("extra_info")
            index = extra.get("index") if isinstance(extra, dict) and extra.get("index") is not None else None
            self.rows.append(
                {
                    "raw_prompt": row[self.prompt_key],
                    "data_source": row["data_source"],
                    "ability": row.get("ability"),
                    "reward_model": row.get("reward_model"),
                    "extra_info": extra,
                    "index": index if index is not None else self.stats["rows_read"] + r,
                }
            )
            self.input_ids.append(list(tokens))
        self.stats["rows_read"] += len(rows)
        self.stats["rows_kept"] += len(rows) - n_filtered
        self.stats["filtered_overlong"] += n_filtered
        self.stats["truncated"] += n_truncated
        if n_filtered:
            log.warning("%s: filtered %d of %d prompts longer than %d tokens", path, n_filtered, len(rows),
                        self.max_prompt_length)
        if n_truncated:
            log.warning("%s: truncated (%s) %d of %d prompts to %d tokens", path, self.policy, n_truncated,
                        len(rows), self.max_prompt_length)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], **self.rows[i]}

    def collate(self, indices: Sequence[int]) -> dict:
        """A generation batch: left-padded prompt tensors plus the per-row fields as lists."""
        return collate_prompts([self[i] for i in indices], self.tokenizer.pad_token_id)


def collate_prompts(items: Sequence[dict], pad_token_id: int) -> dict:
    """Left-pad `input_ids` (generation appends on the right) into input_ids / attention_mask / position_ids."""
    import torch

    width = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        input_ids[b, width - n:] = torch.as_tensor(it["input_ids"], dtype=torch.long)
        attention_mask[b, width - n:] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    for key in items[0]:
        if key != "input_ids":
            out[key] = [it[key] for it in items]
    return out
