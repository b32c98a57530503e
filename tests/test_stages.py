"""Each stage on fake Arrow batches (no Ray), the window's grouping, and the builder's column check."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.builder import Pipeline, PipelineError, Stage
from pipeline.window import Window
from stages.batcher_config import BatcherConfig
from stages.prompts import DataConfig, PromptSource, load_prompts
from stages.reward import Reward, RewardConfig, load_reward_fn
from stages.schema import table_from_columns

# ---- prompt source -------------------------------------------------------------------


def test_parquet_jsonl_and_memory_sources(tmp_path):
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for path in (tmp_path / "p.parquet", tmp_path / "p.jsonl"):
        t = load_prompts(DataConfig(path=str(path), prompt_key="question"))
        assert t.column("prompt").to_pylist() == [r["question"] for r in rows]
        assert t.column("data_source").to_pylist() == ["p"] * 5
    src = PromptSource(DataConfig(path="ignored"), n_samples=3, rows=[{"prompt": "a", "answer": "b"}])
    assert src.groups(range(2)).num_rows == 6


def test_group_order_is_seeded_and_resumable():
    src = PromptSource(DataConfig(path="builtin:addition", train_size=10, seed=3), n_samples=2)
    all_ = src.groups(range(25))
    assert all_.column("group_id").to_pylist() == [g for g in range(25) for _ in range(2)]
    assert all_.column("sample_idx").to_pylist() == [0, 1] * 25
    # resuming at group 7 yields exactly what the uninterrupted stream had there
    assert src.groups(range(7, 12)).to_pylist() == all_.slice(14, 10).to_pylist()
    epoch0 = all_.column("prompt_id").to_pylist()[0:20:2]
    assert sorted(epoch0) == sorted(set(epoch0)) and len(epoch0) == 10   # one epoch = every prompt once
    other = PromptSource(DataConfig(path="builtin:addition", train_size=10, seed=4), n_samples=2).groups(range(10))
    assert other.column("prompt_id").to_pylist() != all_.slice(0, 20).column("prompt_id").to_pylist()


@pytest.mark.parametrize("make,match", [
    (lambda p: None, "data file not found"),
    (lambda p: p.write_text("not parquet"), "cannot read data file"),
    (lambda p: pq.write_table(pa.table({"text": ["x"]}), p), "no prompt column 'prompt'"),
    (lambda p: pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), p), "dataset is empty"),
])
def test_bad_data_fails_naming_file(tmp_path, make, match):
    p = tmp_path / "d.parquet"
    make(p)
    with pytest.raises(ValueError, match=match) as e:
        load_prompts(DataConfig(path=str(p)))
    assert str(p) in str(e.value)


# ---- reward ----------------------------------------------------------------------------

def slow_reward(prompt, response, answer, row):
    import time

    time.sleep(5)
    return 1.0


def raising_reward(prompt, response, answer, row):
    if response == "boom":
        raise RuntimeError("bad row")
    return {"reward": 0.5, "note": "ok"}


def _traj(tok, responses, statuses=None):
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    return table_from_columns({"prompt": ["1+1="] * len(ids), "answer": ["2"] * len(ids), "response_ids": ids,
                               "status": statuses or ["completed"] * len(ids), "error": [""] * len(ids)})


def test_exact_match_and_user_reward(tiny_model_dir):
    r = Reward(RewardConfig(fn="exact_match"), tiny_model_dir)
    out = r(_traj(r.tok, ["2", "3", "2"], ["completed", "completed", "truncated"]))
    assert out.column("reward").to_pylist() == [1.0, 0.0, 0.0]
    r = Reward(RewardConfig(fn="tests.test_stages:raising_reward"), tiny_model_dir)
    r.tok = _CharTok(r.tok)
    out = r(_traj(r.tok, ["12", "boom"]))
    assert out.column("status").to_pylist() == ["completed", "failed"]
    assert out.column("reward").to_pylist() == [0.5, 0.0]
    assert "bad row" in out.column("error")[1].as_py()
    assert json.loads(out.column("reward_info")[0].as_py()) == {"note": "ok"}


class _CharTok:
    """The tiny tokenizer has only digits; let 'boom' round-trip by mapping it to a digit string."""

    def __init__(self, tok):
        self.tok, self.eos_token_id = tok, tok.eos_token_id

    def __call__(self, text, **kw):
        return self.tok("9999" if text == "boom" else text, **kw)

    def decode(self, ids, **kw):
        s = self.tok.decode(ids, **kw)
        return "boom" if s == "9999" else s


def test_reward_timeout_marks_row_failed(tiny_model_dir):
    r = Reward(RewardConfig(fn="tests.test_stages:slow_reward", timeout_s=0.2), tiny_model_dir)
    out = r(_traj(r.tok, ["2"]))
    assert out.column("status")[0].as_py() == "failed" and "timed out" in out.column("error")[0].as_py()
    assert out.column("reward")[0].as_py() == 0.0


def test_reward_path_that_does_not_import():
    with pytest.raises(ValueError, match="reward.fn 'nope.missing:fn' does not import"):
        load_reward_fn("nope.missing:fn")


# ---- the window's grouping --------------------------------------------------------------

def _rows(groups, n, version=0, reward=None):
    g = [x for x in groups for _ in range(n)]
    return table_from_columns({"group_id": g, "sample_idx": [i % n for i in range(len(g))],
                               "status": ["completed"] * len(g),
                               "reward": reward if reward is not None else [float(i % 2) for i in range(len(g))],
                               "token_versions": [[version, version]] * len(g)})


def test_window_emits_whole_groups_in_order():
    b = Window(BatcherConfig(groups_per_step=2), n_samples=3)
    t = _rows([5, 3, 4], 3)
    assert b.feed(t.slice(0, 4)) == [5]          # group 3 has 1 of 3 rows so far
    assert b.take(0) == (None, [])
    assert sorted(b.feed(t.slice(4))) == [3, 4]
    table, dropped = b.take(0)
    assert table.column("group_id").to_pylist() == [3] * 3 + [4] * 3 and dropped == []
    assert b.fairness.groups["completed"] - b.fairness.groups["trained"] == 1      # group 5 waits


def test_window_splits_interleaved_rows_into_their_groups_in_stream_order():
    """Rows arrive as trajectories finish, groups interleaved: each group gets its own rows, in the
    order they came, whatever the block's order."""
    b = Window(BatcherConfig(groups_per_step=3), n_samples=2)
    t = table_from_columns({"group_id": [7, 2, 7, 9, 2, 9], "sample_idx": [1, 0, 0, 1, 1, 0],
                            "status": ["completed"] * 6, "reward": [0.0, 1.0, 1.0, 0.0, 0.0, 1.0],
                            "token_versions": [[0]] * 6})
    assert sorted(b.feed(t)) == [2, 7, 9]
    assert b.feed(t.slice(0, 0)) == []                          # an empty block completes nothing
    table, _ = b.take(0)
    assert table.column("group_id").to_pylist() == [2, 2, 7, 7, 9, 9]
    assert table.column("sample_idx").to_pylist() == [0, 1, 1, 0, 1, 0]
    assert b.fairness.groups["completed"] == 3


def test_window_drops_stale_and_equal_reward_groups():
    b = Window(BatcherConfig(groups_per_step=1, filter_equal_rewards=True), n_samples=2, stale_steps=1)
    b.feed(_rows([0], 2, version=0))                        # staleness 2 at version 2: dropped
    b.feed(_rows([1], 2, version=1, reward=[1.0, 1.0]))    # all rewards equal: filtered
    b.feed(_rows([2], 2, version=1))
    table, dropped = b.take(2)
    assert sorted(dropped) == [0, 1] and table.column("group_id").to_pylist() == [2, 2]
    assert b.fairness.groups["dropped_stale"] == 1 and b.fairness.groups["dropped_filter"] == 1
    assert b.saved() == [0, 1]                  # settled: a resumed run never streams them again


def test_a_waiting_group_ages_with_the_version_and_mask_reads_it_again():
    """The window reads a group's oldest token once; each collection compares it with the version then.
    With stale_policy=mask the masked group's tokens are read again (its oldest is now newer)."""
    b = Window(BatcherConfig(groups_per_step=2), n_samples=2, stale_steps=1)
    b.feed(_rows([0], 2, version=0))
    assert b.take(1) == (None, [])                  # staleness 1: waits for a second group
    assert b.take(2) == (None, [0])                 # staleness 2 > 1: dropped at this collection
    m = Window(BatcherConfig(groups_per_step=1, stale_policy="mask"), n_samples=2, stale_steps=1)
    t = _rows([7], 2, version=0)
    m.feed(t.set_column(t.column_names.index("token_versions"), "token_versions",
                        pa.array([[0, 2], [2, 2]], pa.list_(pa.int64()))))
    table, dropped = m.take(2)
    assert dropped == [] and table.column("loss_mask").to_pylist() == [[0, 1], [1, 1]]


# ---- builder ---------------------------------------------------------------------------

class NeedsScore:
    inputs = ("response_ids", "score")
    outputs = ("bonus",)


def test_builder_names_stage_and_missing_column():
    src = PromptSource(DataConfig(), n_samples=2, rows=[{"prompt": "1+1=", "answer": "2"}])
    from stages.agentflow.rollout import AgentFlowRollout

    stages = [src, Stage(AgentFlowRollout), Stage(NeedsScore)]
    with pytest.raises(PipelineError, match="stage NeedsScore needs column 'score'"):
        Pipeline(stages)
    stages[2] = Stage(NeedsScore, inputs=("response_ids",))
    with pytest.raises(PipelineError, match="the window and the trainer need column 'reward'"):
        Pipeline(stages)
    with pytest.raises(PipelineError, match="starts with a source"):
        Pipeline(stages[1:])
    from stages.reward import Reward as R

    stages[2] = Stage(R)
    assert "reward" in Pipeline(stages).columns
