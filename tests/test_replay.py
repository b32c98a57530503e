"""Recorder, recording checks, replay filters and the record -> replay exactness of a real run."""
import warnings

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from pipeline.builder import Pipeline
from pipeline.config import load_config
from pipeline.recorder import N_SAMPLES_KEY, TMP, VERSION_KEY, Recorder, Recording, RecordingError, RecordingWarning
from pipeline.replay import (
    RecordedSource,
    ReplayConfig,
    ReplayError,
    read_rollouts,
    replay_window,
    select_groups,
)
from stages.schema import COLUMNS, SCHEMA_VERSION, conform
from tests.support.runs import step_table


def record(tmp_path, steps=3, B=2, n=2):
    rec = Recorder(tmp_path, n)
    for s in range(1, steps + 1):
        rec.write(s, step_table(s, B, n))
    return tmp_path / "rollouts"


# ---- recorder -----------------------------------------------------------------------------

def test_recording_is_a_hive_dataset_that_pyarrow_and_pandas_read(tmp_path):
    import pandas as pd

    root = record(tmp_path)
    assert sorted(p.parent.name for p in root.glob("*/part-0.parquet")) == ["step=000001", "step=000002", "step=000003"]
    t = pads.dataset(root, partitioning="hive").to_table()
    assert t.num_rows == 12 and sorted(set(t.column("step").to_pylist())) == [1, 2, 3]
    df = pd.read_parquet(root)
    assert len(df) == 12 and set(df["step"].astype(int)) == {1, 2, 3}
    meta = pq.ParquetFile(root / "step=000002" / "part-0.parquet").schema_arrow.metadata
    assert int(meta[VERSION_KEY]) == SCHEMA_VERSION and int(meta[N_SAMPLES_KEY]) == 2
    # the file holds the step's rows exactly as given, in order
    assert pq.read_table(root / "step=000002").to_pylist() == step_table(2).to_pylist()
    assert not list(root.rglob(".*"))          # nothing half-written left behind


def test_recording_index_and_read(tmp_path):
    rec = Recording.open(record(tmp_path))
    assert rec.steps == [1, 2, 3] and rec.n_samples == 2
    assert rec.groups.column("group_id").to_pylist() == [0, 1, 2, 3, 4, 5]
    assert rec.groups.column("reward").to_pylist() == [0.0, 1.0] * 3
    t = rec.read([3], columns=["group_id", "reward"])
    assert t.column_names == ["group_id", "reward", "step"] and t.column("step").to_pylist() == [3] * 4


# ---- bad recordings -------------------------------------------------------------------------

def test_empty_and_missing_dirs(tmp_path):
    with pytest.raises(RecordingError, match="no such recording directory"):
        Recording.open(tmp_path / "nope")
    (tmp_path / "rollouts").mkdir()
    with pytest.raises(RecordingError, match="empty recording"):
        Recording.open(tmp_path / "rollouts")


def test_missing_column_names_file_and_column(tmp_path):
    root = record(tmp_path)
    bad = root / "step=000002" / "part-0.parquet"
    t = pq.read_table(bad)
    pq.write_table(t.drop_columns(["token_versions"]), bad)
    with pytest.raises(RecordingError, match=r"step=000002/part-0.parquet: missing column\(s\) token_versions"):
        Recording.open(root)


def test_newer_schema_version_is_refused(tmp_path):
    root = record(tmp_path)
    bad = root / "step=000003" / "part-0.parquet"
    t = pq.read_table(bad)
    pq.write_table(t.replace_schema_metadata(t.schema.metadata | {VERSION_KEY: str(SCHEMA_VERSION + 1).encode()}), bad)
    with pytest.raises(RecordingError, match=f"step=000003/part-0.parquet: recorded with trajectory schema version "
                                             f"{SCHEMA_VERSION + 1}, newer"):
        Recording.open(root)


def test_truncated_file_of_an_aborted_run(tmp_path):
    root = record(tmp_path)
    bad = root / "step=000003" / "part-0.parquet"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(RecordingError, match="step=000003/part-0.parquet: not a complete Parquet file"):
        Recording.open(root)


def test_unfinished_write_is_not_part_of_the_recording(tmp_path):
    root = record(tmp_path, steps=2)
    d = root / "step=000003"
    d.mkdir()
    (d / TMP.replace("*", "k3j9x0")).write_bytes(b"PAR1 half a file")
    with pytest.warns(RecordingWarning, match="step=000003/.part-0.parquet.k3j9x0.tmp: unfinished write"):
        rec = Recording.open(root)
    assert rec.steps == [1, 2]
    assert pads.dataset(root, partitioning="hive").to_table().num_rows == 8    # other readers skip it too


def test_partial_group_is_refused(tmp_path):
    root = record(tmp_path)
    bad = root / "step=000001" / "part-0.parquet"
    t = pq.read_table(bad)
    pq.write_table(t.slice(0, 3), bad)     # group 1 keeps 1 of its 2 samples
    with pytest.raises(RecordingError, match="step=000001/part-0.parquet: group 1 has 1 samples, expected 2"):
        Recording.open(root)


def test_the_recorder_never_writes_through_a_planted_file_and_keeps_recordings_owner_only(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    d = tmp_path / "rollouts" / "step=000001"
    d.mkdir(parents=True)
    (d / ".part-0.parquet.tmp").symlink_to(victim)      # the temporary's name before it was random
    Recorder(tmp_path, 2).write(1, step_table(1))
    assert victim.read_text() == "keep me"
    assert pq.read_table(d / "part-0.parquet").to_pylist() == step_table(1).to_pylist()
    assert sorted(p.name for p in d.iterdir()) == [".part-0.parquet.tmp", "part-0.parquet"]   # no temporary left
    new = Recorder(tmp_path / "new", 2).write(1, step_table(1))     # what the recorder creates is owner-only
    assert [p.stat().st_mode & 0o777 for p in (new, new.parent, new.parent.parent)] == [0o600, 0o700, 0o700]


def test_a_live_run_recording_with_several_segments_per_sample_opens(tmp_path):
    """A sample that made several rows (main + subagent) counts once in its group; rows of kinds not
    asked for (a harness's `side` title call) are no group of their own."""
    t = step_table(1, B=2, n=2)
    seg = lambda kind: {"id": 0, "kind": kind, "parent": None, "start": 0, "agent": ""}  # noqa: E731
    extra = t.slice(0, 1).to_pylist()[0] | {"segment": seg("subagent")}
    side = t.slice(0, 1).to_pylist()[0] | {"group_id": 9, "segment": seg("side")}
    Recorder(tmp_path, 2).write(1, conform(pa.Table.from_pylist(t.to_pylist() + [extra, side], schema=t.schema)))
    assert Recording.open(tmp_path / "rollouts", kinds=("main", "subagent")).groups.column("group_id").to_pylist() \
        == [0, 1]
    with pytest.raises(RecordingError, match="group 9 has 1 samples, expected 2"):
        Recording.open(tmp_path / "rollouts")          # every kind: the side row is a partial group


# ---- filters and the replay source ----------------------------------------------------------

def test_filters_keep_whole_groups(tmp_path):
    rec = Recording.open(record(tmp_path, steps=3, B=4, n=2))
    gids = lambda f: select_groups(rec, f).column("group_id").to_pylist()  # noqa: E731
    assert gids(ReplayConfig()) == list(range(12))
    assert gids(ReplayConfig(steps=(3, 1))) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert gids(ReplayConfig(data_sources=("odd",))) == [1, 3, 5, 7, 9, 11]
    assert gids(ReplayConfig(reward_min=1.0, reward_max=2.0)) == [1, 2, 5, 6, 9, 10]
    with pytest.raises(ReplayError, match=r"replay.steps: \[7\] not in the recording"):
        gids(ReplayConfig(steps=(7,)))
    with pytest.raises(ReplayError, match=r"replay.data_sources: \['gsm8k'\] not in the recording"):
        gids(ReplayConfig(data_sources=("gsm8k",)))
    df = read_rollouts(tmp_path, ReplayConfig(reward_min=3.0))
    assert sorted(set(df["group_id"])) == [3, 7, 11] and (df["reward"] == 3.0).all()


def test_source_blocks_keep_recorded_order_and_step_boundaries(tmp_path):
    rec = Recorder(tmp_path, 2)
    rec.write(1, step_table(1, B=3, order=[2, 0, 1]))    # rows as a batcher might have ordered them
    rec.write(2, step_table(2, B=3))
    recording = Recording.open(tmp_path / "rollouts")
    src = RecordedSource(recording, select_groups(recording, ReplayConfig()))
    assert src.num_groups == 6 and src.step_ends() == [3, 6]
    blocks = [b.column("group_id").to_pylist() for b in src.blocks(0, 6, groups_per_block=2)]
    assert blocks == [[2, 2, 0, 0], [1, 1], [3, 3, 4, 4], [5, 5]]       # never a block across two steps
    assert [b.column("group_id").to_pylist() for b in src.blocks(1, 3, 8)] == [[0, 0, 1, 1], [3, 3]]
    assert set(src.outputs) >= set(COLUMNS)


def test_replay_loop_rebatches_filtered_groups(ray_session, tmp_path):
    """The real source -> Ray Data -> window path: B groups per step, group order as a run's window gives."""
    root = record(tmp_path, steps=4, B=4, n=2)
    rec = Recording.open(root)
    cfg = load_config("configs/quickstart.yaml", ["batcher.groups_per_step=2", "rollout.n_samples=2"])
    source = RecordedSource(rec, select_groups(rec, ReplayConfig(reward_min=1.0)))     # 3 of 4 groups per step
    window = replay_window(cfg, Pipeline([source]), source)
    seen = []
    while (table := window.next_step(len(seen))) is not None:
        seen.append(table.column("group_id").to_pylist())
        assert table.schema.metadata[VERSION_KEY] == str(SCHEMA_VERSION).encode()
    steps = [[1, 2], [3, 5], [6, 7], [9, 10], [11, 13], [14, 15]]
    assert seen == [[g for g in s for _ in range(2)] for s in steps]


# ---- record a real run, replay it, compare exactly ------------------------------------------

# the entropy bonus gives every step a gradient even when a barely warmed policy gets reward 0 everywhere
FAST = ["run.steps=3", "batcher.groups_per_step=4", "rollout.n_samples=4", "sampling.max_new_tokens=5",
        "eval.num_prompts=0", "engine.count=1", "trainer.mini_batch_size=8", "algorithm.entropy_coef=0.01"]


@pytest.fixture(scope="module")
def recorded_run(ray_session, tiny_model_dir, tmp_path_factory):
    """One synchronous 3-step run of the real pipeline (2 optimizer steps per step: the permutation RNG is used)."""
    from pipeline.controller import Controller

    run = tmp_path_factory.mktemp("recorded") / "run"
    ctl = Controller(load_config("configs/quickstart.yaml", FAST + [f"model.path={tiny_model_dir}"]), run,
                     log=lambda *_: None)
    try:
        ctl.run()
    finally:
        ctl.stop()
    return run


def train_lines(run):
    from pipeline.metrics import read_metrics

    return [(m["step"], m["train/loss"], m["train/grad_norm"]) for m in read_metrics(run) if "train/loss" in m]


def test_replay_reproduces_loss_grad_norm_and_weights_exactly(recorded_run, tiny_model_dir, tmp_path):
    import ray
    import torch
    from safetensors.torch import load_file

    from pipeline.replay import replay, resolve_replay_config

    rollouts = recorded_run / "rollouts"
    assert ray.data.read_parquet(str(rollouts)).count() == 3 * 16
    summary = replay(rollouts, resolve_replay_config(rollouts, None, []), tmp_path / "replay", log=lambda *_: None)
    assert summary["steps"] == 3

    original, replayed = train_lines(recorded_run), train_lines(tmp_path / "replay")
    assert [s for s, *_ in original] == [1, 2, 3] and all(g > 0 for *_, g in original)
    assert replayed == original                      # floats compared exactly, step by step
    for k in (1, 2, 3):                              # the replay trained on the very same tables
        a = pq.read_table(rollouts / f"step={k:06d}")
        b = pq.read_table(tmp_path / "replay" / "rollouts" / f"step={k:06d}")
        assert a.select(COLUMNS).equals(b.select(COLUMNS))
    w0 = load_file(recorded_run / "checkpoints" / "step_000003" / "model.safetensors")
    w1 = load_file(tmp_path / "replay" / "checkpoints" / "step_000003" / "model.safetensors")
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    base = load_file(f"{tiny_model_dir}/model.safetensors")
    assert any(not torch.equal(base[k], w1[k]) for k in base)     # and training did move the weights

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a complete replay leaves a complete profile
        from pipeline.planner.spans import load_spans

        spans = load_spans(tmp_path / "replay")
    assert list(spans.loc[spans["stage"] == "update", "step"]) == [1, 2, 3]


def test_a_run_records_profiles_and_tracks_through_the_hooks(recorded_run):
    """Needs the controller/builder hooks: Recorder, Profiler on every stage, trackers."""
    from pipeline.planner.spans import load_spans

    meta = pq.ParquetFile(recorded_run / "rollouts" / "step=000001" / "part-0.parquet").schema_arrow.metadata
    assert int(meta[N_SAMPLES_KEY]) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spans = load_spans(recorded_run)
    stages = set(spans["stage"])
    assert {"AgentFlowRollout", "Reward", "batcher", "update", "sync"} <= stages
    assert spans.loc[spans["stage"] == "Reward", "rows_out"].sum() == 3 * 16
    assert list(spans.loc[spans["stage"] == "update", "step"]) == [1, 2, 3]
    assert any((recorded_run / "tensorboard").glob("events.out.tfevents.*"))


def test_cli_replay_with_filters_and_profile(recorded_run, tmp_path, capsys):
    """Needs the cli/config hooks: `loongsage replay` and `loongsage profile`."""
    from pipeline.cli import main

    out = tmp_path / "filtered"
    assert main(["replay", str(recorded_run / "rollouts"), "replay.steps=[2,3]", "--run-dir", str(out)]) == 0
    assert [s for s, *_ in train_lines(out)] == [1, 2]
    assert train_lines(out)[0] != train_lines(recorded_run)[1]      # step 2's data on the start weights
    assert "replayed 2 steps" in capsys.readouterr().out
    assert main(["replay", str(recorded_run / "rollouts"), "replay.data_sources=[nope]"]) == 2
    assert "not in the recording" in capsys.readouterr().err
    assert main(["profile", str(recorded_run), "--out", str(tmp_path / "plots")]) == 0
    text = capsys.readouterr().out
    assert "AgentFlowRollout" in text and "trainer idle" in text
    assert {p.name for p in (tmp_path / "plots").glob("*.png")} == {"gantt.png", "throughput.png", "bubbles.png",
                                                                   "staleness.png"}


def _served(root, n: int, side: bool):
    """A recording like `loongsage serve`'s: 2 steps of 2 groups of n samples, equal rewards within a group,
    and (side) a harness's title call, a `side` row of a group of its own."""
    rec = Recorder(root, n)
    for step in (1, 2):
        t = step_table(step, B=2, n=n)
        title = {"id": 1, "kind": "side", "parent": None, "start": 0, "agent": ""}
        rows = t.to_pylist() + ([r | {"group_id": 100 + step, "segment": title} for r in t.slice(0, n).to_pylist()]
                                if side else [])
        rec.write(step, conform(pa.Table.from_pylist(rows, schema=t.schema)))
    return root / "rollouts"


@pytest.mark.parametrize("n, side, why", [(1, True, "2 groups of one sample: no advantage"),
                                          (2, False, "2 groups, each of equal rewards: zero advantage")])
def test_a_replay_that_trains_nothing_says_why_each_step_and_never_nan(ray_session, tiny_model_dir, tmp_path,
                                                                       capsys, n, side, why):
    from pipeline.cli import main
    from pipeline.metrics import read_metrics

    out = tmp_path / "replayed"
    assert main(["replay", str(_served(tmp_path / "served", n, side)), "configs/quickstart.yaml",
                 f"model.path={tiny_model_dir}", f"rollout.n_samples={n}", "batcher.groups_per_step=2",
                 "trainer.mini_batch_size=2", "--run-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert [x for x in said.splitlines() if x.startswith("step ")] == [
        f"step 1: nothing to train ({why})", f"step 2: nothing to train ({why})"]      # the side rows made no step
    assert "nan" not in said and "replayed 2 steps (2 of them trained nothing)" in said
    lines = read_metrics(out)
    assert [m["train/skipped_steps"] for m in lines] == [1, 2]
    assert all(m.get("train/grad_norm", 0.0) == 0.0 and all(v == v for v in m.values()) for m in lines)   # no NaN
    assert set(read_rollouts(out)["group_id"]) == {0, 1, 2, 3}                  # trained rows: no side row

