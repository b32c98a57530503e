"""Whole runs: the short-run overrides, the weights an engine actor serves, and what a resumed run's
recorded rollouts must show (the multi-node and multi-host tests)."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import ray

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
