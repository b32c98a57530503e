"""What a resumed run must show in its recorded rollouts, shared by the multi-node and multi-host tests."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq


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
