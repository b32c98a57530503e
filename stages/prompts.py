"""Prompt source: Parquet / JSONL / in-memory / built-in task -> a Ray Data stream of samples.

Why it exists: it fixes the data order. Group `seq` g (= group_id) is the g-th prompt of
an endless sequence of epochs, each a seeded permutation, so any position in the stream
is reproducible from (seed, g) alone: resuming at group g loses and repeats nothing.
Each group is expanded into N sample rows, and blocks are cut on group boundaries.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stages.prompts_config import DataConfig
from stages.schema import TRAJECTORY_SCHEMA


def _read_file(path: str) -> pa.Table:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data file not found: {p}")
    try:
        if p.is_dir() or p.suffix == ".parquet":
            return pq.read_table(p)
        if p.suffix in (".jsonl", ".json"):
            import pyarrow.json as pj

            if p.suffix == ".json" and p.read_text().lstrip().startswith("["):
                return pa.Table.from_pylist(json.loads(p.read_text()))
            return pj.read_json(p)
    except (pa.ArrowInvalid, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read data file {p}: {e}") from e
    raise ValueError(f"data file {p}: unsupported format {p.suffix!r} (use .parquet, .jsonl or .json)")


def load_prompts(cfg: DataConfig, path: str | None = None, split: str = "train", rows: list[dict] | None = None,
                 size: int = 0) -> pa.Table:
    """Read and validate prompts into a table: prompt_id, data_source, prompt, answer."""
    path = cfg.path if path is None else path
    if rows is not None:
        table, where = pa.Table.from_pylist(rows), "in-memory rows"
    elif path.startswith("builtin:"):
        from stages.tasks import get_task

        task = get_task(path.split(":", 1)[1], digits=cfg.builtin_digits)
        table, where = pa.Table.from_pylist(task.make_rows(split, size, seed=cfg.seed)), path
    else:
        table, where = _read_file(path), path
    if table.num_rows == 0:
        raise ValueError(f"{where}: the dataset is empty")
    if cfg.prompt_key not in table.column_names:
        raise ValueError(f"{where}: no prompt column {cfg.prompt_key!r} (columns: {table.column_names}); "
                         f"set data.prompt_key")
    n = table.num_rows
    source_default = cfg.data_source or (path.split(":", 1)[1] if path.startswith("builtin:") else Path(path).stem)
    sources = (table.column(cfg.data_source_key).to_pylist() if cfg.data_source_key in table.column_names
               else [source_default] * n)
    answers = (table.column(cfg.answer_key).to_pylist() if cfg.answer_key in table.column_names else [""] * n)
    prompts = table.column(cfg.prompt_key).to_pylist()
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str) or not p]
    if bad:
        raise ValueError(f"{where}: row {bad[0]} has an empty or non-text {cfg.prompt_key!r}")
    out = pa.table({
        "prompt_id": [f"{source_default}-{i}" for i in range(n)],
        "data_source": [str(s) for s in sources],
        "prompt": prompts,
        "answer": ["" if a is None else str(a) for a in answers],
    })
    if size and size < n and not path.startswith("builtin:"):
        out = out.slice(0, size)
    return out


class PromptSource:
    """Driver-side source: the prompt table and the deterministic group order."""
    inputs: tuple = ()
    outputs = ("prompt_id", "group_id", "sample_idx", "data_source", "prompt", "answer")

    def __init__(self, cfg: DataConfig, n_samples: int, rows: list[dict] | None = None):
        self.cfg = cfg
        self.n_samples = n_samples
        self.table = load_prompts(cfg, rows=rows, size=cfg.train_size)

    def order(self, epoch: int) -> np.ndarray:
        n = self.table.num_rows
        return np.random.default_rng([self.cfg.seed, epoch]).permutation(n) if self.cfg.shuffle else np.arange(n)

    def groups(self, seqs) -> pa.Table:
        """Sample rows of the given group seqs, N rows per group, in the given order."""
        seqs, n, k = np.asarray(list(seqs), dtype=np.int64), self.table.num_rows, self.n_samples
        idx = np.empty(len(seqs), dtype=np.int64)
        for epoch in np.unique(seqs // n):
            at = seqs // n == epoch
            idx[at] = self.order(int(epoch))[seqs[at] % n]
        rows, field = self.table.take(np.repeat(idx, k)), TRAJECTORY_SCHEMA.field
        return pa.table({"prompt_id": rows["prompt_id"],
                         "group_id": pa.array(np.repeat(seqs, k), field("group_id").type),
                         "sample_idx": pa.array(np.tile(np.arange(k), len(seqs)), field("sample_idx").type),
                         "data_source": rows["data_source"], "prompt": rows["prompt"], "answer": rows["answer"]})

    def dataset(self, start: int, num_groups: int, groups_per_block: int, skip: frozenset = frozenset()):
        """A Ray Dataset of `num_groups` groups from `start`, one block (one rollout call) per
        `groups_per_block` groups: a call blocked at the window gate holds no finished groups."""
        import ray

        seqs = [g for g in range(start, start + num_groups) if g not in skip]   # skip: settled before a resume
        # from_blocks keeps the blocks as given and reads their metadata here (from_arrow runs a task per block)
        return ray.data.from_blocks([self.groups(seqs[i:i + groups_per_block])
                                     for i in range(0, len(seqs), groups_per_block)])
