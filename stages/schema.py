"""The trajectory row: one Arrow schema for every stage, the recorder and replay.

Stages add columns to a batch; the full row a trainer consumes has every column below.
The schema is versioned: recordings carry `SCHEMA_VERSION` in their file metadata and a
reader refuses a newer one rather than guessing.
"""
from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 3   # 2: optional agent and teacher top-k columns (a v1 recording reads as v2 with nulls)
                     # 3: optional segment columns (a trajectory may make several rows; v1/v2 read with nulls)

STATUSES = ("completed", "truncated", "aborted", "failed")

_i64 = pa.int64()
_i32_list = pa.list_(pa.int32())
_f32_list = pa.list_(pa.float32())

# per trajectory: model turns, tool calls, token segments, wall and generation seconds, failure kind
AGENT_STATS = pa.struct([("turns", pa.int32()), ("tool_calls", pa.int32()), ("segments", pa.int32()),
                         ("wall_s", pa.float64()), ("gen_s", pa.float64()), ("fail", pa.string())])

# a row's place in its trajectory's segment tree (stages/agentflow/session.py)
SEGMENT = pa.struct([("id", pa.int32()), ("kind", pa.string()), ("parent", pa.int32()), ("start", pa.int32()),
                     ("agent", pa.string())])
# per trajectory (black-box): segments by kind, prompt tokens reused from recorded streams vs tokenized fresh,
# bytes of prompt text the proxy had recorded already (history re-sent)
SEGMENT_STATS = pa.struct([("main", pa.int32()), ("compaction", pa.int32()), ("subagent", pa.int32()),
                           ("reused_tokens", pa.int64()), ("fresh_tokens", pa.int64()), ("resent_bytes", pa.int64()),
                           ("side", pa.int32())])      # side calls (a harness's title calls), last: older files lack it

FIELDS: list[pa.Field] = [
    # identity: a group is N samples of one prompt; seq orders groups in the data stream
    pa.field("prompt_id", pa.string()),
    pa.field("group_id", _i64),
    pa.field("sample_idx", pa.int32()),
    pa.field("data_source", pa.string()),
    pa.field("prompt", pa.string()),          # text, or chat messages as JSON
    pa.field("answer", pa.string()),          # reference answer for rule rewards ("" if none)
    # tokens, from the engine
    pa.field("prompt_ids", _i32_list),
    pa.field("response_ids", _i32_list),
    pa.field("response_logprobs", _f32_list),
    pa.field("loss_mask", pa.list_(pa.int8())),
    pa.field("token_versions", _i32_list),    # weight version that produced each response token
    pa.field("version_start", _i64),
    pa.field("version_end", _i64),
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    # scoring
    pa.field("reward", pa.float32()),
    pa.field("reward_info", pa.string()),     # JSON
    pa.field("teacher_id", pa.string()),
    pa.field("teacher_logprobs", _f32_list),
    # timing (unix seconds)
    pa.field("t_dispatch", pa.float64()),
    pa.field("t_done", pa.float64()),
    # optional: what an agent reported (stages/agentflow) and the teacher's top-k (GKD)
    pa.field("agent_reward", pa.float64()),   # reward the agent itself reported (null = none)
    pa.field("agent_info", pa.string()),      # JSON the agent reported alongside it
    pa.field("transcript", pa.string()),      # the trajectory as chat messages JSON
    pa.field("agent_stats", AGENT_STATS),
    pa.field("teacher_topk_ids", pa.list_(_i32_list)),        # [T][K] teacher's most likely ids per position
    pa.field("teacher_topk_logprobs", pa.list_(_f32_list)),   # [T][K] their log-probs
    pa.field("segment", SEGMENT),             # null: the trajectory's only row (no agent, or before schema 3)
    pa.field("segment_stats", SEGMENT_STATS),
    pa.field("proxy_notes", pa.list_(pa.string())),   # black-box: what its requests asked that the proxy accepted
                                                      # without honouring (unknown fields, hosted tools, our cuts)
]

TRAJECTORY_SCHEMA = pa.schema(FIELDS, metadata={b"loongsage.schema_version": str(SCHEMA_VERSION).encode()})
COLUMNS = tuple(f.name for f in FIELDS)
_BY_NAME = {f.name: f for f in FIELDS}


def field(name: str) -> pa.Field:
    return _BY_NAME[name]


def table_from_columns(columns: dict[str, list]) -> pa.Table:
    """Build a table whose known columns carry the schema's types (unknown ones are inferred)."""
    arrays, fields = [], []
    for name, values in columns.items():
        f = _BY_NAME.get(name)
        arr = pa.array(values, type=f.type if f is not None else None)
        arrays.append(arr)
        fields.append(f if f is not None else pa.field(name, arr.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def with_columns(table: pa.Table, columns: dict[str, list]) -> pa.Table:
    """Return `table` with `columns` set (replaced if present, appended otherwise)."""
    for name, values in columns.items():
        f = _BY_NAME.get(name)
        arr = pa.array(values, type=f.type if f is not None else None)
        idx = table.schema.get_field_index(name)
        new_field = f if f is not None else pa.field(name, arr.type)
        table = table.set_column(idx, new_field, arr) if idx >= 0 else table.append_column(new_field, arr)
    return table


# Columns only some pipelines produce (no teacher stage -> no teacher columns): null when absent.
OPTIONAL = ("teacher_id", "teacher_logprobs", "agent_reward", "agent_info", "transcript", "agent_stats",
            "teacher_topk_ids", "teacher_topk_logprobs", "segment", "segment_stats", "proxy_notes")


def conform(table: pa.Table) -> pa.Table:
    """Order and type a complete trajectory table as TRAJECTORY_SCHEMA (extra columns kept at the end)."""
    for c in OPTIONAL:
        if c not in table.column_names:
            table = table.append_column(_BY_NAME[c], pa.nulls(table.num_rows, _BY_NAME[c].type))
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"trajectory table lacks columns {missing}; has {table.column_names}")
    extra = [c for c in table.column_names if c not in _BY_NAME]
    cols = [table.column(c).cast(_BY_NAME[c].type) for c in COLUMNS] + [table.column(c) for c in extra]
    schema = pa.schema(FIELDS + [table.schema.field(c) for c in extra], metadata=TRAJECTORY_SCHEMA.metadata)
    return pa.Table.from_arrays(cols, schema=schema)
