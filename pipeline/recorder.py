"""Recorder and reader of RUN_DIR/rollouts/step=000001/part-0.parquet: the rows each step trained, in order.

A hive-partitioned Parquet dataset (Ray, pyarrow and pandas read `step` as a column), written a step at a time,
each file whole or not at all; it holds every prompt and completion, so it is 0700 / 0600. File metadata
carries the schema version, the step and the group size; `Recording.open` checks every file before anything
reads rows, so replay never trains on partial rows.
"""
from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stages.schema import COLUMNS, SCHEMA_VERSION, conform

VERSION_KEY = b"loongsage.schema_version"
STEP_KEY = b"loongsage.step"
N_SAMPLES_KEY = b"loongsage.n_samples"
PART = "part-0.parquet"
TMP = f".{PART}.*.tmp"        # write_atomic's temporaries (a glob)


class RecordingError(ValueError):
    pass


class RecordingWarning(UserWarning):
    pass


class Recorder:
    def __init__(self, run_dir: str | Path, n_samples: int):
        self.root = Path(run_dir) / "rollouts"
        self.n_samples = n_samples

    def write(self, step: int, table: pa.Table) -> Path:
        table = conform(table)
        meta = dict(table.schema.metadata or {}) | {
            VERSION_KEY: str(SCHEMA_VERSION).encode(), STEP_KEY: str(step).encode(),
            N_SAMPLES_KEY: str(self.n_samples).encode()}
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        d = self.root / f"step={step:06d}"
        d.mkdir(mode=0o700, exist_ok=True)
        return write_atomic(table.replace_schema_metadata(meta), d / PART)


def write_atomic(table: pa.Table, final: Path) -> Path:
    """Write `table` to `final` whole or not at all: into a hidden owner-only temporary beside it (created
    exclusively: a planted symlink is never followed; readers skip its dot and .tmp), then renamed."""
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pq.write_table(table, f)
        os.replace(tmp, final)       # atomic: readers see the whole file or nothing
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return final


StepFile = collections.namedtuple("StepFile", "step path n_samples")


def _check_file(path: Path) -> StepFile:
    """Read one file's footer (no rows) and check it is a whole recording of this schema."""
    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise RecordingError(f"{path}: not a complete Parquet file ({e}). The run that wrote it was probably "
                             f"aborted mid-write; delete this step directory to use the steps before it") from None
    meta = f.schema_arrow.metadata or {}
    if VERSION_KEY not in meta:
        raise RecordingError(f"{path}: no {VERSION_KEY.decode()} in the file metadata: not written by the "
                             f"LoongSage recorder")
    version = int(meta[VERSION_KEY])
    if version > SCHEMA_VERSION:
        raise RecordingError(f"{path}: recorded with trajectory schema version {version}, newer than this "
                             f"LoongSage's {SCHEMA_VERSION}; replay it with a newer LoongSage")
    missing = [c for c in COLUMNS if c not in f.schema_arrow.names]
    if missing:
        raise RecordingError(f"{path}: missing column(s) {', '.join(missing)} of the trajectory schema")
    step = int(meta.get(STEP_KEY, path.parent.name.split("=", 1)[-1]))
    return StepFile(step, path, int(meta.get(N_SAMPLES_KEY, 0)))


class Recording:
    """A checked recording: its step files and a per-group index (step, group_id, data_source, reward).
    With `kinds` (agent.train_segments) only rows of those segment kinds are seen, as a run trains
    only those: a `side` row (a harness's title call) recorded by `loongsage serve` is not a group."""

    def __init__(self, root: Path, files: list[StepFile], groups: pa.Table, n_samples: int, kinds=None):
        self.root, self.files, self.groups, self.n_samples, self.kinds = root, files, groups, n_samples, kinds
        self._by_step = {f.step: f for f in files}

    @classmethod
    def open(cls, rollouts_dir: str | Path, kinds: tuple[str, ...] | None = None) -> "Recording":
        root = Path(rollouts_dir)
        if not root.is_dir():
            raise RecordingError(f"{root}: no such recording directory (expected RUN_DIR/rollouts)")
        for u in sorted(root.glob(f"step=*/{TMP}")):
            if not (u.parent / PART).exists():
                warnings.warn(f"{u}: unfinished write of an aborted run; step {u.parent.name} is not part of the "
                              f"recording", RecordingWarning, stacklevel=2)
        paths = sorted(root.glob("step=*/*.parquet"))
        if not paths:
            raise RecordingError(f"{root}: empty recording (no step=N/*.parquet files)")
        files = sorted((_check_file(p) for p in paths), key=lambda f: f.step)
        dup = [a.path for a, b in zip(files, files[1:]) if a.step == b.step]
        if dup:
            raise RecordingError(f"{dup[0].parent}: more than one file for step {dup[0].parent.name}")
        indexed = [_group_index(f, kinds) for f in files]
        sizes = {f.path: n for f, (_, n) in zip(files, indexed) if n}
        if len(set(sizes.values())) > 1:
            raise RecordingError(f"{root}: group sizes differ between steps ({sizes}): not one run's recording")
        return cls(root, files, pa.concat_tables([t for t, _ in indexed]), max(sizes.values(), default=0), kinds)

    @property
    def steps(self) -> list[int]:
        return [f.step for f in self.files]

    def read_step(self, step: int, group_ids=None, columns=None) -> pa.Table:
        """One step's rows in recorded order, optionally only the given groups / columns."""
        cols = columns if columns is None or self.kinds is None else list(dict.fromkeys([*columns, "segment"]))
        t = of_kinds(pq.read_table(self._by_step[step].path, columns=cols), self.kinds)
        t = t if cols == columns else t.select(columns)
        if group_ids is not None:
            t = t.filter(pc.is_in(t.column("group_id"), pa.array(sorted(group_ids), pa.int64())))
        return t

    def read(self, steps=None, columns=None) -> pa.Table:
        """Rows of the given steps (default all) with a `step` column, like the hive readers give."""
        parts = []
        for s in (self.steps if steps is None else steps):
            t = self.read_step(s, columns=columns)
            parts.append(t.append_column("step", pa.array([s] * t.num_rows, pa.int32())))
        return pa.concat_tables(parts, promote_options="default")


def of_kinds(t: pa.Table, kinds: tuple[str, ...] | None) -> pa.Table:
    """The rows whose segment is of one of `kinds` (all for None; a row with no segment is its trajectory's
    only one, a `main` row)."""
    if kinds is None:
        return t
    kind = pc.fill_null(pc.struct_field(t.column("segment"), "kind"), "main")
    return t.filter(pc.is_in(kind, pa.array(list(kinds), pa.string())))


def _group_index(f: StepFile, kinds=None) -> tuple[pa.Table, int]:
    """One file's group index and its group size in samples (a trajectory of several segment rows is one
    sample); a group short of the recorded n_samples (or of the file's largest group, without it) is an error."""
    t = of_kinds(pq.read_table(f.path, columns=["group_id", "sample_idx", "data_source", "reward", "segment"]), kinds)
    g = t.group_by(["group_id", "data_source"], use_threads=False).aggregate(
        [("reward", "mean"), ("sample_idx", "count_distinct")])
    samples = g.column("sample_idx_count_distinct").to_pylist()
    n = f.n_samples or max(samples, default=0)
    for gid, r in zip(g.column("group_id").to_pylist(), samples):
        if r != n:
            raise RecordingError(f"{f.path}: group {gid} has {r} samples, expected {n} (rollout.n_samples); "
                                 f"a partial group cannot be trained")
    if g.num_rows != len(set(g.column("group_id").to_pylist())):
        raise RecordingError(f"{f.path}: a group spans several data sources")
    return pa.table({"step": pa.array([f.step] * g.num_rows, pa.int64()), "group_id": g.column("group_id"),
                     "data_source": g.column("data_source"), "reward": g.column("reward_mean")}), n
