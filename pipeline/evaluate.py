"""Periodic evaluation on held-out prompts, straight on the engines (no training data path).

Samples at the configured temperature (the training temperature by default), scores with
the run's reward function, and reports eval/accuracy (fraction of samples with reward 1)
and eval/reward_mean.
"""
from __future__ import annotations

import time

import pyarrow as pa
import ray

from stages.schema import table_from_columns


def evaluate(engines: list, reward_stage, prompts: pa.Table, tok, temperature: float, max_new_tokens: int,
             n_samples: int = 1, seed: int | None = None) -> dict:
    """`seed`: sample k draws with seed + k, whatever engine and batch it lands in (every evaluation of a
    run draws the same numbers: accuracy moves with the weights, not with the draws); None: the engines'
    own streams."""
    t0 = time.time()
    rows = prompts.to_pylist()
    reqs = [{"prompt_ids": tok(r["prompt"], add_special_tokens=False)["input_ids"], "max_new_tokens": max_new_tokens,
             "temperature": temperature, "hold": True} for r in rows for _ in range(n_samples)]
    if seed is not None:
        reqs = [r | {"seed": seed + k} for k, r in enumerate(reqs)]
    shards = [reqs[i::len(engines)] for i in range(len(engines))]
    outs = ray.get([e.generate.remote(s) for e, s in zip(engines, shards)])
    results = [None] * len(reqs)
    for i, out in enumerate(outs):
        results[i::len(engines)] = out
    expanded = [r for r in rows for _ in range(n_samples)]
    table = table_from_columns({   # group and sample: a user reward fn's row["seed"] differs per sample
        "group_id": [i // n_samples for i in range(len(expanded))],
        "sample_idx": [i % n_samples for i in range(len(expanded))],
        "prompt": [r["prompt"] for r in expanded], "answer": [r["answer"] for r in expanded],
        "data_source": [r["data_source"] for r in expanded],
        "response_ids": [o["response_ids"] for o in results], "status": [o["status"] for o in results],
        "error": [""] * len(results),
    })
    scored = reward_stage(table)
    rewards = scored.column("reward").to_pylist()
    out = {"eval/accuracy": sum(r >= 1.0 - 1e-6 for r in rewards) / len(rewards),
           "eval/reward_mean": sum(rewards) / len(rewards),
           "eval/response_len": sum(len(o["response_ids"]) for o in results) / len(results),
           "eval/seconds": time.time() - t0, "eval/n": len(rewards)}
    sources = scored.column("data_source").to_pylist()
    if len(set(sources)) > 1:
        for s in sorted(set(sources)):
            rs = [r for r, src in zip(rewards, sources) if src == s]
            out[f"eval/accuracy/{s}"] = sum(r >= 1.0 - 1e-6 for r in rs) / len(rs)
    return out


def evaluate_agent(rollout_stage, reward_stage, prompts: pa.Table, n_samples: int = 1, batch: int = 64) -> dict:
    """Held-out accuracy of the recipe's own agent (multi-turn, tools, black-box programs):
    each prompt runs through `rollout_stage` (an AgentFlowRollout on the live engines, no
    window gate) and `reward_stage`, exactly as training trajectories do."""
    t0 = time.time()
    rows = [r for r in prompts.to_pylist() for _ in range(n_samples)]
    rewards, stats, lens = [], [], []
    for lo in range(0, len(rows), batch):
        part = rows[lo: lo + batch]
        table = table_from_columns({
            "prompt_id": [r.get("prompt_id", "") for r in part], "group_id": list(range(lo, lo + len(part))),
            "sample_idx": [0] * len(part), "data_source": [r["data_source"] for r in part],
            "prompt": [r["prompt"] for r in part], "answer": [r["answer"] for r in part]})
        scored = reward_stage(rollout_stage(table))
        rewards += scored.column("reward").to_pylist()
        stats += [s or {} for s in scored.column("agent_stats").to_pylist()]
        lens += [len(x) for x in scored.column("response_ids").to_pylist()]
    n = len(rewards)
    return {"eval/accuracy": sum(r >= 1.0 - 1e-6 for r in rewards) / n, "eval/reward_mean": sum(rewards) / n,
            "eval/response_len": sum(lens) / n, "eval/turns": sum(s.get("turns") or 0 for s in stats) / n,
            "eval/tool_calls": sum(s.get("tool_calls") or 0 for s in stats) / n,
            "eval/failed": sum(bool(s.get("fail")) for s in stats), "eval/seconds": time.time() - t0, "eval/n": n}
