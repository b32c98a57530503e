"""Whole runs: the short-run overrides, the weights an engine actor serves, and what a resumed run's
recorded rollouts must show (the multi-node and multi-host tests), and a recorded step's table."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from stages.schema import COLUMNS, conform, table_from_columns

# a few short steps on the tiny model, two engines
FAST = ["run.steps=3", "batcher.groups_per_step=4", "rollout.n_samples=4", "sampling.max_new_tokens=5",
        "eval.every=2", "eval.num_prompts=16", "engine.count=2",
        # partial credit: the barely-warmed test model rarely gets an exact answer, and a step whose
        # rewards are all equal has zero advantage (no update)
        "reward.fn=stages.tasks.rewards:digit_match", "trainer.lr=0.001", "trainer.mini_batch_size=0"]


def _model_state(engine) -> dict:
    return {n: t.clone() for n, t in engine.model.state_dict().items()}


def served_weights(engine) -> ray.ObjectRef:
    """The weights an HF engine actor serves now, read on the actor itself (Ray's `__ray_call__` runs
    a function on the actor's instance): a copy of its model's whole state dict."""
    return engine.__ray_call__.remote(_model_state)


def assert_stream_resumed(run_dir: Path, state: dict, steps: int) -> None:
    """Every step 1..steps trained once; the groups trained before the checkpoint (`state`, its
    controller.json) are exactly its done_seqs, none trained again, and none skipped after it."""
    trained = pq.ParquetDataset(Path(run_dir) / "rollouts", partitioning="hive").read(columns=["group_id", "step"])
    by_step: dict[int, set] = {}
    for g, s in zip(trained.column("group_id").to_pylist(), trained.column("step").to_pylist()):
        by_step.setdefault(s, set()).add(g)
    assert sorted(by_step) == list(range(1, steps + 1)), sorted(by_step)     # every step once
    before = set().union(*(by_step[s] for s in by_step if s <= state["step"]))
    after = set().union(*(by_step[s] for s in by_step if s > state["step"]))
    assert before == set(state["done_seqs"]) and not before & after, (before, after)   # nothing trained twice
    assert min(after) == max(before) + 1, (before, after)      # nothing skipped: the stream goes on where it was


def step_table(step: int, B: int = 2, n: int = 2, order=None) -> pa.Table:
    """B groups of n rows for `step`; group g of the step has reward g and data source "even"/"odd"."""
    rows = []
    for g in order or range(B):
        gid = (step - 1) * B + g
        for i in range(n):
            k = i + 1
            rows.append(dict(prompt_id=f"p{gid}", group_id=gid, sample_idx=i, data_source=("even", "odd")[g % 2],
                             prompt="1+1=", answer="2", prompt_ids=[5, 6], response_ids=[7] * k,
                             response_logprobs=[-0.25] * k, loss_mask=[1] * k, token_versions=[step - 1] * k,
                             version_start=step - 1, version_end=step - 1, status="completed", error="",
                             reward=float(g), reward_info="{}", teacher_id=None, teacher_logprobs=None,
                             t_dispatch=100.0 + step, t_done=100.5 + step))
    return conform(table_from_columns({c: [r.get(c) for r in rows] for c in COLUMNS}))
