"""The rollout batch's columns, defined once: name, Arrow type, meaning, whether the trainer requires
it. The batch builder, the trainability check, the stored Arrow schema and the column tables of
docs/ are all made from this table, so editing a meaning changes the stored schema (SCHEMA_VERSION)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    meaning: str
    nullable: bool = False
    required: bool = False
    """The trainer refuses a batch without it (data/validation.py)."""


def _list(item: pa.DataType) -> pa.ListType:
    # Parquet's compliant nested naming calls a list item "element"; using it here keeps the
    # type, and hence the stored checksum, identical after a Parquet round trip.
    return pa.list_(pa.field("element", item))


WEIGHT_SPAN = pa.struct(
    [
        pa.field("version", pa.int64(), nullable=False),
        pa.field("start", pa.int64(), nullable=False),
        pa.field("end", pa.int64(), nullable=False),
    ]
)

BATCH_COLUMNS: tuple[Column, ...] = (
    Column("prompt_id", pa.string(), "dataset id of the prompt"),
    Column("group_index", pa.int64(), "group counter inside the rollout (samples of one prompt share it)"),
    Column("index", pa.int64(), "position of the sample inside its group"),
    Column("tokens", _list(pa.int32()), "prompt + response token ids", required=True),
    Column("prompt_length", pa.int64(), "number of prompt tokens"),
    Column("response_length", pa.int64(), "number of response tokens (the last ones of `tokens`)", required=True),
    Column("total_length", pa.int64(), "prompt_length + response_length = len(tokens)"),
    Column(
        "loss_mask",
        _list(pa.int8()),
        "one per response token; 0 = not trained (tool output, off-policy part)",
        required=True,
    ),
    Column(
        "rollout_log_probs",
        _list(pa.float32()),
        "engine log-probs, one per response token (may be empty when not collected)",
    ),
    Column("raw_reward", pa.float64(), "reward as scored (null: not scored, e.g. aborted)", nullable=True),
    Column(
        "reward",
        pa.float64(),
        "reward after group normalisation (GRPO: (r - mean) / (std_unbiased + 1e-6))",
        nullable=True,
    ),
    Column("advantage", pa.float64(), "scalar advantage of the sample (GRPO: = reward)", nullable=True),
    Column("status", pa.string(), "Sample.Status value: completed, truncated, aborted, failed"),
    Column("finish_reason", pa.string(), "vLLM finish reason (stop, length, abort)"),
    Column(
        "weight_versions",
        _list(WEIGHT_SPAN),
        "spans {version, start, end} over response tokens: tokens [start, end) came from weights `version`",
    ),
    Column("session_id", pa.string(), "routing key sent as x-session-id"),
    Column("is_eval", pa.bool_(), "sample of an eval rollout"),
    Column("metadata", pa.string(), "free-form per-sample metadata, a JSON string"),
    Column(
        "routed_experts",
        pa.large_binary(),
        "expert ids the engine routed each token to: .npy bytes of [rows, engine layers, top_k] uint8 (uint16 "
        "above 256 experts), row t = token t, rows <= total_length - 1 (the last token is never forwarded); "
        "null when not recorded (use_rollout_routing_replay off)",
        nullable=True,
    ),
)
COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in BATCH_COLUMNS)
REQUIRED_COLUMNS: tuple[str, ...] = tuple(c.name for c in BATCH_COLUMNS if c.required)
