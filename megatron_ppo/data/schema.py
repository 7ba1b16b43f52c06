"""Arrow schemas of the two parquet formats, and the column checks shared by their readers.

Prompt parquet (verl's schema, any `data_source`): `data_source`, `prompt` (chat messages), `ability`,
`reward_model{style, ground_truth}`, `extra_info{...}`. Trajectory parquet = prompt columns + the response and the
behaviour policy's per-token log-probs (see docs/data.md for both, with worked examples).
"""
from __future__ import annotations

import pyarrow as pa

from megatron_ppo.errors import UsageError

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
GSM8K_EXTRA_INFO = pa.struct(
    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
)

# The file `megatron-ppo preprocess gsm8k` writes (identical to verl's examples/data_preprocess/gsm8k.py output).
GSM8K_PROMPT_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("ability", pa.string()),
        ("reward_model", REWARD_MODEL),
        ("extra_info", GSM8K_EXTRA_INFO),
    ]
)

# Columns every prompt parquet must have; the others (ability, reward_model, extra_info, anything else) pass through.
PROMPT_REQUIRED = ("data_source", "prompt")

BEHAVIOUR_POLICY = pa.struct([("name", pa.string()), ("step", pa.int64()), ("temperature", pa.float64())])

# Columns the trajectory format adds to the prompt columns, with their fixed types.
TRAJECTORY_FIELDS = {
    "response": pa.string(),  # decoded response text (optional when response_ids is present)
    "prompt_ids": pa.list_(pa.int32()),  # optional: the exact prompt tokens the behaviour policy saw
    "response_ids": pa.list_(pa.int32()),  # optional when `response` text is present (then tokenised on read)
    "rollout_log_probs": pa.list_(pa.float32()),  # required: one per response token, behaviour policy, <= 0
    "reward": pa.float64(),  # optional scalar reward; null = score it at training time
    "behaviour_policy": BEHAVIOUR_POLICY,  # optional metadata: model name, training step, sampling temperature
}
TRAJECTORY_REQUIRED = ("data_source", "prompt", "rollout_log_probs")


class SchemaError(UsageError):
    """A parquet file does not have the columns or types its format needs; the message names file and column."""


def require_columns(schema: pa.Schema, required: tuple[str, ...], source: str, fmt: str) -> None:
    missing = [name for name in required if name not in schema.names]
    if missing:
        raise SchemaError(
            f"{source}: missing required column(s) {missing} for the {fmt} format; "
            f"columns present: {schema.names}"
        )


def check_prompt_column(schema: pa.Schema, source: str, prompt_key: str = "prompt") -> None:
    """`prompt` must be a list of {role, content} messages (verl's chat format), not a plain string."""
    field = schema.field(prompt_key)
    ok = pa.types.is_list(field.type) or pa.types.is_large_list(field.type)
    if ok:
        item = field.type.value_type
        ok = pa.types.is_struct(item) and {"role", "content"} <= {item.field(i).name for i in range(item.num_fields)}
    if not ok:
        raise SchemaError(
            f"{source}: column {prompt_key!r} has type {field.type}; expected a list of "
            "{role: string, content: string} chat messages (verl's prompt format)"
        )
