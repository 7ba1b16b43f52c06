"""Trajectory (offline) parquet: prompt columns + response + behaviour-policy log-probs (+ optional reward).

Written by `TrajectoryWriter` (one file per rollout step under `rollout.dump_dir`) and read back for offline PPO by
`TrajectoryDataset`. Every file is validated the same way on write and on read:
  - required columns: data_source, prompt, rollout_log_probs, and response_ids and/or response (text);
  - per row, len(response_ids) == len(rollout_log_probs);
  - log-probs finite and <= 0; reward (when present and not null) finite;
  - an empty response (no tokens) is filtered — counted and logged — or an error, per `empty_response_policy`.
Errors name the file (or "batch"), the row and the column.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatron_ppo.data.parquet_io import atomic_write_table, expand_parquet_paths, read_tables
from megatron_ppo.data.schema import (
    BEHAVIOUR_POLICY, MESSAGE, TRAJECTORY_FIELDS, TRAJECTORY_REQUIRED, SchemaError, check_prompt_column,
    require_columns,
)
from megatron_ppo.errors import UsageError

log = logging.getLogger(__name__)

EMPTY_RESPONSE_POLICIES = ("filter", "error")
PASSTHROUGH = ("ability", "reward_model", "extra_info")


class TrajectoryError(UsageError):
    """A trajectory row breaks the format's rules; the message names the file, row and column."""


def _list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False)


def _first_null(column: pa.ChunkedArray) -> int | None:
    if column.null_count == 0:
        return None
    return int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])


def validate_trajectory_table(table: pa.Table, source: str, empty_response_policy: str = "filter"
                              ) -> tuple[pa.Table, int]:
    """Check a trajectory table; returns (table without empty responses, number filtered). Raises on bad rows."""
    if empty_response_policy not in EMPTY_RESPONSE_POLICIES:
        raise ValueError(f"empty_response_policy={empty_response_policy!r}; choose one of {EMPTY_RESPONSE_POLICIES}")
    names = table.schema.names
    require_columns(table.schema, TRAJECTORY_REQUIRED, source, "trajectory parquet")
    if "response_ids" not in names and "response" not in names:
        raise SchemaError(f"{source}: trajectory parquet needs column 'response_ids' or 'response' (text); "
                          f"columns present: {names}")
    check_prompt_column(table.schema, source)
    for name in ("rollout_log_probs", "response_ids", "prompt_ids", "reward", "response"):
        if name in names:
            try:
                table = table.set_column(names.index(name), name, table[name].cast(TRAJECTORY_FIELDS[name]))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaError(f"{source}: column {name!r} has type {table.schema.field(name).type}, expected "
                                  f"{TRAJECTORY_FIELDS[name]} ({e})") from None
    for name in ("rollout_log_probs", "response_ids", "prompt_ids"):
        if name in names and (row := _first_null(table[name])) is not None:
            raise TrajectoryError(f"{source}: row {row}: column {name!r} is null")
    logp = table["rollout_log_probs"]
    n_logp = _list_lengths(logp)
    if "response_ids" in names:
        n_ids = _list_lengths(table["response_ids"])
        if (bad := np.flatnonzero(n_ids != n_logp)).size:
            r = int(bad[0])
            raise TrajectoryError(f"{source}: row {r}: 'response_ids' has {n_ids[r]} tokens but 'rollout_log_probs' "
                                  f"has {n_logp[r]} values; they must agree one to one")
    values = pc.list_flatten(logp).to_numpy(zero_copy_only=False)
    if (bad := np.flatnonzero(~(np.isfinite(values) & (values <= 0)))).size:
        parents = pc.list_parent_indices(logp).to_numpy(zero_copy_only=False)
        r = int(parents[bad[0]])
        pos = int(bad[0] - np.concatenate([[0], np.cumsum(n_logp)])[r])
        raise TrajectoryError(f"{source}: row {r}: 'rollout_log_probs'[{pos}] = {float(values[bad[0]])}; "
                              "log-probs must be finite and <= 0")
    if "reward" in names:
        reward = table["reward"].to_numpy(zero_copy_only=False)  # nulls become NaN here: check validity first
        valid = table["reward"].is_valid().to_numpy(zero_copy_only=False)
        if (bad := np.flatnonzero(valid & ~np.isfinite(reward))).size:
            r = int(bad[0])
            raise TrajectoryError(f"{source}: row {r}: 'reward' = {float(reward[r])} is not finite "
                                  "(leave it null to score the response at training time)")
    empty = n_logp == 0
    if "response_ids" not in names:  # text only: an empty string is an empty response
        empty |= pc.fill_null(pc.utf8_length(table["response"]), 0).to_numpy(zero_copy_only=False) == 0
    if empty.any():
        rows = np.flatnonzero(empty)
        if empty_response_policy == "error":
            raise TrajectoryError(f"{source}: row {int(rows[0])}: empty response ({rows.size} row(s) in all); "
                                  "set empty_response_policy='filter' to drop them")
        log.warning("%s: filtered %d trajectory row(s) with an empty response (rows %s%s)", source, rows.size,
                    rows[:10].tolist(), "..." if rows.size > 10 else "")
        table = table.filter(pa.array(~empty))
    return table, int(empty.sum())


def _ragged(values: Sequence, dtype, name: str) -> pa.Array:
    """A list column from a sequence of 1-D lists / numpy arrays / tensors, without a Python loop over tokens."""
    target = np.dtype(dtype.to_pandas_dtype())
    arrays = []
    for row, v in enumerate(values):
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        a = np.asarray(v)
        if a.ndim != 1:
            raise TrajectoryError(f"batch: row {row}: column {name!r} must be 1-D per row, got shape {a.shape}")
        if a.size and pa.types.is_integer(dtype) and not np.issubdtype(a.dtype, np.integer):
            raise TrajectoryError(f"batch: row {row}: column {name!r} must hold integer token ids, got {a.dtype}")
        arrays.append(a.astype(target, copy=False))
    offsets = np.concatenate([[0], np.cumsum([a.size for a in arrays])]).astype(np.int32)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, target)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def unpad(padded, mask) -> list[np.ndarray]:
    """Per-row 1-D arrays of the positions where `mask` is set (e.g. response tokens of a [B, R] tensor)."""
    padded = padded.detach().cpu().numpy() if hasattr(padded, "detach") else np.asarray(padded)
    mask = (mask.detach().cpu().numpy() if hasattr(mask, "detach") else np.asarray(mask)).astype(bool)
    return [row[m] for row, m in zip(padded, mask)]


def trajectory_table(batch: Mapping[str, Sequence], behaviour_policy: Mapping | None = None) -> pa.Table:
    """Columns of one rollout batch -> an Arrow table with the trajectory schema's types."""
    sizes = {k: len(v) for k, v in batch.items()}
    if len(set(sizes.values())) > 1:
        raise TrajectoryError(f"batch: columns have different row counts {sizes}")
    n = next(iter(sizes.values()), 0)
    cols: dict[str, pa.Array] = {}
    for name in batch:
        if name not in {"data_source", "prompt", *PASSTHROUGH, *TRAJECTORY_FIELDS}:
            raise TrajectoryError(f"batch: unknown column {name!r}; put extra per-row data in 'extra_info'")
    if "data_source" in batch:
        cols["data_source"] = pa.array(list(batch["data_source"]), pa.string())
    if "prompt" in batch:
        cols["prompt"] = pa.array([list(p) for p in batch["prompt"]], pa.list_(MESSAGE))
    for name in PASSTHROUGH:
        if name in batch:
            cols[name] = pa.array(list(batch[name]))
    if "response" in batch:
        cols["response"] = pa.array(list(batch["response"]), pa.string())
    for name in ("prompt_ids", "response_ids", "rollout_log_probs"):
        if name in batch:
            cols[name] = _ragged(batch[name], TRAJECTORY_FIELDS[name].value_type, name)
    if "reward" in batch:
        cols["reward"] = pa.array([None if r is None else float(r) for r in batch["reward"]], pa.float64())
    if "behaviour_policy" in batch:
        cols["behaviour_policy"] = pa.array(list(batch["behaviour_policy"]), BEHAVIOUR_POLICY)
    elif behaviour_policy is not None:
        cols["behaviour_policy"] = pa.array([dict(behaviour_policy)] * n, BEHAVIOUR_POLICY)
    return pa.table(cols)


_ROW = "__megatron_ppo_file_row"
TOKENIZER_METADATA = b"megatron_ppo.tokenizer_sha256"  # parquet schema metadata: which tokenizer the ids are of


def tokenizer_fingerprint(tokenizer) -> str | None:
    """sha256 of the tokenizer's token -> id map (what the stored ids mean); None without a tokenizer."""
    if tokenizer is None:
        return None
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


class TrajectoryWriter:
    """Dumps rollout batches for later offline replay: `append(step, batch)` writes `step_{step:08d}.parquet`.

    One file per step, written atomically; appending the same step again (a resumed run redoing it) replaces that
    step's file instead of duplicating its rows. The batch is validated before anything is written.
    """

    def __init__(self, dump_dir: str | Path, policy_name: str | None = None, temperature: float | None = None,
                 tokenizer=None):
        """tokenizer: its fingerprint goes into each file's metadata, so an offline run with another tokenizer
        refuses the ids instead of training on what they mean there."""
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self.policy_name, self.temperature = policy_name, temperature
        self.fingerprint = tokenizer_fingerprint(tokenizer)

    def path_for(self, step: int) -> Path:
        return self.dump_dir / f"step_{step:08d}.parquet"

    def append(self, step: int, batch: Mapping[str, Sequence]) -> Path:
        policy = {"name": self.policy_name, "step": int(step), "temperature": self.temperature}
        table = trajectory_table(batch, policy)
        table, _ = validate_trajectory_table(table, f"batch (step {step})", empty_response_policy="error")
        if self.fingerprint is not None:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                                   TOKENIZER_METADATA: self.fingerprint.encode()})
        path = self.path_for(step)
        if path.exists():
            log.warning("trajectory dump %s exists; replacing it (step %d was run again)", path, step)
        return atomic_write_table(table, path)


class TrajectoryDataset:
    """Validated trajectory rows with token ids for prompt and response.

    Prompt ids come from `prompt_ids` when stored, else from the tokenizer's chat template; response ids from
    `response_ids`, else by tokenising `response` (then its token count must match the log-probs).
    Item i: prompt_ids, response_ids (list[int]), rollout_log_probs (float32 array), reward (float | None),
    raw_prompt, data_source, reward_model, extra_info, ability, behaviour_policy, response (text | None),
    source ("<file>: row <r>", for errors), tokenizer (the writer's tokenizer fingerprint, or None).
    """

    def __init__(self, data_files: str | Path | Iterable[str | Path], tokenizer=None,
                 empty_response_policy: str = "filter"):
        self.tokenizer = tokenizer
        self.items: list[dict] = []
        self.stats = {"rows_read": 0, "rows_kept": 0, "filtered_empty_response": 0}
        for path, table in read_tables(expand_parquet_paths(data_files)):
            n_read = table.num_rows
            table = table.append_column(_ROW, pa.array(np.arange(n_read)))  # file rows survive the filtering
            table, n_empty = validate_trajectory_table(table, str(path), empty_response_policy)
            kept = table[_ROW].to_numpy()
            self._add(path, table.drop_columns([_ROW]), kept)
            self.stats["rows_read"] += n_read
            self.stats["filtered_empty_response"] += n_empty
        self.stats["rows_kept"] = len(self.items)
        if not self.items:
            raise ValueError(f"data_files {data_files}: no trajectory rows left (stats: {self.stats})")

    def _need_tokenizer(self, path: Path, column: str):
        if self.tokenizer is None:
            raise ValueError(f"{path}: no {column!r} column, so a tokenizer is needed to tokenise it")
        return self.tokenizer

    def _add(self, path: Path, table: pa.Table, kept_rows: np.ndarray) -> None:
        names = table.schema.names
        fingerprint = (table.schema.metadata or {}).get(TOKENIZER_METADATA)
        fingerprint = fingerprint.decode() if fingerprint is not None else None
        rows = table.to_pylist()
        if "prompt_ids" in names:
            prompt_ids = [r["prompt_ids"] for r in rows]
        else:
            from megatron_ppo.data.prompt_dataset import chat_prompt_ids

            prompt_ids = chat_prompt_ids(self._need_tokenizer(path, "prompt_ids"), [r["prompt"] for r in rows])
        if "response_ids" in names:
            response_ids = [r["response_ids"] for r in rows]
        else:
            from megatron_ppo.data.prompt_dataset import encode_texts

            response_ids = encode_texts(self._need_tokenizer(path, "response_ids"), [r["response"] for r in rows])
            for i, (ids, r) in enumerate(zip(response_ids, rows)):
                if len(ids) != len(r["rollout_log_probs"]):
                    raise TrajectoryError(f"{path}: row {i}: 'response' tokenises to {len(ids)} tokens but "
                                          f"'rollout_log_probs' has {len(r['rollout_log_probs'])} values "
                                          "(store 'response_ids' to pin the exact tokens)")
        for r, p_ids, r_ids, row in zip(rows, prompt_ids, response_ids, kept_rows):
            self.items.append({
                "source": f"{path}: row {int(row)}",
                "tokenizer": fingerprint,
                "prompt_ids": list(p_ids),
                "response_ids": list(r_ids),
                "rollout_log_probs": np.asarray(r["rollout_log_probs"], dtype=np.float32),
                "reward": r.get("reward"),
                "raw_prompt": r["prompt"],
                "data_source": r["data_source"],
                "reward_model": r.get("reward_model"),
                "extra_info": r.get("extra_info"),
                "ability": r.get("ability"),
                "behaviour_policy": r.get("behaviour_policy"),
                "response": r.get("response"),
            })

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]
