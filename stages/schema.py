"""The trajectory row: one Arrow schema for every stage, the recorder and replay.

Stages add columns to a batch; the full row a trainer consumes has every column below.
The schema is versioned: recordings carry `SCHEMA_VERSION` in their file metadata and a
reader refuses a newer one rather than guessing.
"""
from __future__ import annotations

import math

import pyarrow as pa

SCHEMA_VERSION = 3   # 2 added the agent and teacher top-k columns, 3 the segment ones; older files read them as nulls

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
    pa.field("status", pa.string()),          # completed | truncated | aborted | failed
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


def _column(name: str, values: list) -> tuple[pa.Field, pa.Array]:
    """A known column with the schema's type, an unknown one with the type inferred."""
    f = _BY_NAME.get(name)
    arr = pa.array(values, type=f.type if f is not None else None)
    return (f if f is not None else pa.field(name, arr.type)), arr


def table_from_columns(columns: dict[str, list]) -> pa.Table:
    cols = [_column(n, v) for n, v in columns.items()]
    return pa.Table.from_arrays([a for _, a in cols], schema=pa.schema([f for f, _ in cols]))


def with_columns(table: pa.Table, columns: dict[str, list]) -> pa.Table:
    """Return `table` with `columns` set (replaced if present, appended otherwise)."""
    for name, values in columns.items():
        f, arr = _column(name, values)
        idx = table.schema.get_field_index(name)
        table = table.set_column(idx, f, arr) if idx >= 0 else table.append_column(f, arr)
    return table


# Columns only some pipelines produce (no teacher stage -> no teacher columns): null when absent.
OPTIONAL = ("teacher_id", "teacher_logprobs", "agent_reward", "agent_info", "transcript", "agent_stats",
            "teacher_topk_ids", "teacher_topk_logprobs", "segment", "segment_stats", "proxy_notes")


def conform(table: pa.Table) -> pa.Table:
    """Order and type a complete trajectory table as TRAJECTORY_SCHEMA (extra columns kept at the end)."""
    missing = [c for c in COLUMNS if c not in table.column_names and c not in OPTIONAL]
    if missing:
        raise ValueError(f"trajectory table lacks columns {missing}; has {table.column_names}")
    extra = [c for c in table.column_names if c not in _BY_NAME]
    cols = [table.column(c).cast(_BY_NAME[c].type) if c in table.column_names
            else pa.nulls(table.num_rows, _BY_NAME[c].type) for c in COLUMNS] + [table.column(c) for c in extra]
    schema = pa.schema(FIELDS + [table.schema.field(c) for c in extra], metadata=TRAJECTORY_SCHEMA.metadata)
    return pa.Table.from_arrays(cols, schema=schema)


# ---- token versions: what the loss keeps of a row -------------------------------------------

def oldest_trained_version(t: pa.Table) -> float:
    """The oldest weight version among a group's model tokens in the loss; -inf if it has model tokens
    but none is left in the loss, +inf if it has no model token at all (never stale)."""
    versions = t.column("token_versions").to_pylist()
    trained = [v for vs, ks in zip(versions, _loss_masks(t)) for v, k in zip(vs, ks) if v >= 0 and k]
    if trained:
        return min(trained)
    return -math.inf if any(v >= 0 for vs in versions for v in vs) else math.inf


def _loss_masks(t: pa.Table) -> list[list[int]]:
    if "loss_mask" in t.column_names:
        return t.column("loss_mask").to_pylist()
    return [[1] * len(vs) for vs in t.column("token_versions").to_pylist()]


def mask_stale(table: pa.Table, oldest: int) -> pa.Table:
    """batcher.stale_policy=mask: tokens generated before version `oldest` leave the loss (they stay in
    the row as context the newer tokens were sampled after)."""
    masks = [[k if v < 0 or v >= oldest else 0 for v, k in zip(vs, ks)]
             for vs, ks in zip(table.column("token_versions").to_pylist(), _loss_masks(table))]
    return with_columns(table, {"loss_mask": masks})


def mask_old_versions(table: pa.Table) -> pa.Table:
    """rollout.partial_mask_old: train only on tokens generated by a row's newest weight version."""
    masks = [[k if v == end else 0 for v, k in zip(vs, mask)] for vs, mask, end in zip(
        table.column("token_versions").to_pylist(), table.column("loss_mask").to_pylist(),
        table.column("version_end").to_pylist())]
    return with_columns(table, {"loss_mask": masks})


# ---- a step's figures: pure functions of the table it trained on ---------------------------------

def step_metrics(t: pa.Table, version: int) -> dict:
    """Rewards, lengths and statuses of a step's rows, how stale its trained tokens were at `version`
    (the version it was trained at), and what its agents reported."""
    rewards = t.column("reward").to_pylist()
    lens = [len(r) for r in t.column("response_ids").to_pylist()]
    status = t.column("status").to_pylist()
    gaps, spans = [], []
    for vs, mask in zip(t.column("token_versions").to_pylist(), t.column("loss_mask").to_pylist()):
        model = [v for v, k in zip(vs, mask) if v >= 0 and k]
        gaps += [version - v for v in model]
        spans.append(max(model) - min(model) if model else 0)
    return {"rollout/reward_mean": sum(rewards) / len(rewards),
            "rollout/accuracy": sum(r >= 1 - 1e-6 for r in rewards) / len(rewards),
            "rollout/response_len": sum(lens) / len(lens), "rollout/samples": len(rewards),
            "rollout/tokens": sum(lens), "rollout/failed": status.count("failed"),
            "rollout/truncated": status.count("truncated"),
            "rollout/span_s": max(t.column("t_done").to_pylist()) - min(t.column("t_dispatch").to_pylist()),
            "staleness/mean": sum(gaps) / max(len(gaps), 1), "staleness/max": max(gaps, default=0),
            "partial_ratio": sum(s > 0 for s in spans) / max(len(spans), 1),       # rows spanning an update
            "partial_span_max": max(spans)} | agent_metrics(t)


def agent_metrics(t: pa.Table) -> dict:
    """Means of what the agents reported per trajectory (a trajectory of several segment rows counts
    once): turns, tool calls, token segments (by kind), prompt-prefix reuse, history re-sent, timings."""
    first: dict[tuple, tuple] = {}
    for k, s, g in zip(zip(t.column("group_id").to_pylist(), t.column("sample_idx").to_pylist()),
                       t.column("agent_stats").to_pylist(), t.column("segment_stats").to_pylist()):
        first.setdefault(k, (s, g))
    stats = [s for s, _ in first.values() if s]
    if not stats:
        return {}
    m = {f"agent/{k}": sum(s[k] or 0 for s in stats) / len(stats)
         for k in ("turns", "tool_calls", "segments", "wall_s", "gen_s")}
    m["agent/failed"] = sum(bool(s["fail"]) for s in stats)
    m["agent/rows_per_trajectory"] = t.num_rows / len(first)
    segs = [g for _, g in first.values() if g]
    if segs:
        for kind in ("main", "compaction", "subagent"):
            m[f"agent/segments_{kind}"] = sum(g[kind] or 0 for g in segs) / len(segs)
        reused, fresh = sum(g["reused_tokens"] or 0 for g in segs), sum(g["fresh_tokens"] or 0 for g in segs)
        m["agent/prefix_reuse"] = reused / max(1, reused + fresh)   # prompt tokens taken from recorded streams
        m["agent/resent_kb"] = sum(g["resent_bytes"] or 0 for g in segs) / len(segs) / 1024
    return m
