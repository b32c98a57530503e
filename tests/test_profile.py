"""Profiler: spans from wrapped stages (in process and in Ray Data actors); reading them back: the loader,
the analysis, the report (pipeline/planner/spans.py)."""
import asyncio
import os
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import ray

from pipeline.planner.spans import (
    ProfileError,
    ProfileWarning,
    bubbles,
    load_spans,
    profile_report,
    queue_depths,
    stage_table,
    staleness,
    throughput,
)
from pipeline.profile import Profiler, SpanSink, profiled

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Ray workers get the toy stages by value


class Respond:
    """A toy map stage: k response tokens per row."""
    inputs, outputs = ("group_id",), ("response_ids",)

    def __init__(self, k: int):
        self.k = k

    def __call__(self, batch: pa.Table) -> pa.Table:
        if batch.num_rows == 0:
            raise RuntimeError("empty batch")
        return batch.append_column("response_ids", pa.array([[1] * self.k] * batch.num_rows, pa.list_(pa.int32())))


class AsyncRespond(Respond):
    async def __call__(self, batch):
        await asyncio.sleep(0)
        return Respond.__call__(self, batch)


def groups(first: int, count: int, n: int = 2) -> pa.Table:
    return pa.table({"group_id": pa.array([g for g in range(first, first + count) for _ in range(n)], pa.int64())})


# ---- recording --------------------------------------------------------------------------------

def test_profiled_stage_records_one_span_per_call(tmp_path):
    prof = Profiler(tmp_path, remote=False)
    cls = profiled(Respond, prof)
    assert profiled(Respond, None) is Respond
    assert cls.__name__ == "Respond" and issubclass(cls, Respond) and cls.outputs == ("response_ids",)
    stage = cls(3)
    for g in (0, 2, 4):
        time.sleep(0.02)
        assert stage(groups(g, 2)).column("response_ids").to_pylist() == [[1, 1, 1]] * 4
    assert prof.close()["spans"] == 3
    s = load_spans(tmp_path)
    assert list(s["stage"]) == ["Respond"] * 3 and set(s["actor"]) == {f"Respond:{os.getpid()}"}
    assert list(s["batch_id"]) == [0, 2, 4] and list(s["rows_in"]) == [4] * 3 and list(s["rows_out"]) == [4] * 3
    assert list(s["tokens"]) == [12] * 3 and list(s["step"]) == [-1] * 3
    assert (s["end"] >= s["start"]).all() and (s["wait_s"] >= 0.015).all()     # it slept between calls
    assert s["overhead_s"].iloc[0] == 0 and (s["overhead_s"].iloc[1:] > 0).all()
    assert s.attrs["complete"]


def test_async_stage_and_failing_call_are_recorded(tmp_path):
    prof = Profiler(tmp_path, remote=False)
    stage = profiled(AsyncRespond, prof)(2)
    out = asyncio.run(stage(groups(7, 1)))
    assert out.num_rows == 2
    with pytest.raises(RuntimeError, match="empty batch"):
        asyncio.run(stage(groups(0, 0)))
    prof.close()
    s = load_spans(tmp_path)
    assert list(s["rows_in"]) == [2, 0] and list(s["rows_out"]) == [2, 0] and list(s["batch_id"]) == [7, -1]


def test_spans_from_ray_data_actors(ray_session, tmp_path):
    """A profiled class in a map_batches actor pool (called as pipeline/builder.py calls it) sends its spans
    from the actor."""
    from ray.data import ActorPoolStrategy

    from stages.prompts import DataConfig, PromptSource

    prof = Profiler(tmp_path)
    ds = PromptSource(DataConfig(train_size=20), 2).dataset(0, 6, 2).map_batches(
        profiled(Respond, prof), fn_constructor_args=(4,), batch_size=4, batch_format="pyarrow",
        compute=ActorPoolStrategy(size=1), num_cpus=0.1)
    parts = list(ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0))
    assert sum(p.num_rows for p in parts) == 12
    prof.add("update", time.time() - 0.5, time.time(), actor="trainer", step=1, rows_in=4)
    summary = prof.close()
    s = load_spans(tmp_path)
    assert summary["spans"] == len(s) == 4
    stage = s[s["stage"] == "Respond"]
    assert sorted(stage["batch_id"]) == [0, 2, 4] and (stage["tokens"] == 16).all()
    assert os.getpid() not in {int(a.split(":")[1]) for a in stage["actor"]}
    assert list(s.loc[s["stage"] == "update", "actor"]) == ["trainer"]


# ---- a synthetic two-step synchronous run ---------------------------------------------------

T0 = 1000.0


def span(stage, actor, start, end, step=-1, rows_in=0, rows_out=0, tokens=0, batch_id=-1):
    return dict(stage=stage, actor=actor, step=step, batch_id=batch_id, rows_in=rows_in, rows_out=rows_out,
                tokens=tokens, start=T0 + start, end=T0 + end, wait_s=0.0, overhead_s=1e-4)


SYNC_RUN = [
    span("batcher", "driver", 0.0, 4.2, step=1, rows_out=8),
    span("AgentFlowRollout", "AgentFlowRollout:1", 0.0, 3.5, rows_in=8, rows_out=8, tokens=40, batch_id=0),
    span("Reward", "Reward:2", 3.5, 4.0, rows_in=8, rows_out=8, tokens=40, batch_id=0),
    span("update", "trainer", 4.2, 6.2, step=1, rows_in=8),
    span("sync", "trainer", 6.2, 6.5, step=1),
    span("batcher", "driver", 6.5, 10.0, step=2, rows_out=8),
    span("AgentFlowRollout", "AgentFlowRollout:1", 6.5, 9.5, rows_in=8, rows_out=8, tokens=40, batch_id=4),
    span("Reward", "Reward:2", 9.5, 9.8, rows_in=8, rows_out=8, tokens=40, batch_id=4),
    span("update", "trainer", 10.0, 11.0, step=2, rows_in=8),
    span("sync", "trainer", 11.0, 11.2, step=2),
]


def write_run(run_dir, spans, close=True):
    sink = SpanSink(str(run_dir / "profile"))
    sink.add(spans)
    if close:
        sink.close()
    else:
        sink.flush()
    return run_dir


def test_stage_table_and_bubbles(tmp_path):
    s = load_spans(write_run(tmp_path, SYNC_RUN))
    t = stage_table(s)
    assert list(t.index) == ["AgentFlowRollout", "Reward", "batcher", "update", "sync"]
    r = t.loc["AgentFlowRollout"]
    assert r["calls"] == 2 and r["rows"] == 16 and r["tokens"] == 80
    assert r["busy_s"] == pytest.approx(6.5) and r["rows_per_s"] == pytest.approx(16 / 6.5)
    assert r["tokens_per_s"] == pytest.approx(80 / 6.5) and r["busy_frac"] == pytest.approx(6.5 / 11.2)
    assert t.loc["update", "rows"] == 16 and t.loc["update", "busy_s"] == pytest.approx(3.0)
    b = bubbles(s)
    assert list(b["step"]) == [1, 2]
    assert list(b["wall_s"]) == pytest.approx([6.5, 4.7])
    assert list(b["trainer_idle_s"]) == pytest.approx([4.5, 3.7])
    assert list(b["rollout_busy_s"]) == pytest.approx([4.0, 3.3])
    assert list(b["rollout_idle_s"]) == pytest.approx([2.5, 1.4])
    # with rollouts, generation time comes from the rows' own dispatch/done times
    rows = pd.DataFrame({"t_dispatch": [T0 + 1.0, T0 + 2.0], "t_done": [T0 + 3.0, T0 + 7.0]})
    assert list(bubbles(s, rows)["rollout_busy_s"]) == pytest.approx([5.5, 0.5])


def test_queue_depths_throughput_and_staleness(tmp_path):
    s = load_spans(write_run(tmp_path, SYNC_RUN))
    q = queue_depths(s)
    assert set(q["queue"]) == {"Reward", "update"}
    upd = q[q["queue"] == "update"]
    assert upd["depth"].max() == 8 and upd["depth"].iloc[-1] == 0
    waiting = upd[upd["depth"] == 8]["t"]
    assert list(waiting) == pytest.approx([4.0, 9.8])                 # rewarded rows wait for the trainer
    th = throughput(s, bin_s=1.0)
    assert list(th.columns) == ["AgentFlowRollout", "Reward", "batcher", "update"]     # sync moves no rows
    assert list(th.index) == [float(t) for t in range(12)]                               # empty bins kept
    assert th["AgentFlowRollout"].sum() == 16 and th.loc[3.0, "AgentFlowRollout"] == 8 and th.loc[4.0, "Reward"] == 8
    rollouts = pd.DataFrame({"step": [1, 2, 2], "token_versions": [[0, 0], [0, 1], [-1, 1]],
                             "loss_mask": [[1, 1], [1, 0], [1, 1]]})
    assert sorted(staleness(rollouts)) == [0, 0, 0, 1]


# ---- bad profiles ---------------------------------------------------------------------------

def test_loader_on_aborted_and_truncated_profiles(tmp_path):
    with pytest.raises(ProfileError, match="no profile directory"):
        load_spans(tmp_path / "none")
    (tmp_path / "empty" / "profile").mkdir(parents=True)
    with pytest.raises(ProfileError, match="empty profile"):
        load_spans(tmp_path / "empty")
    aborted = write_run(tmp_path / "aborted", SYNC_RUN, close=False)
    with pytest.warns(ProfileWarning, match=r"did not finish \(no _complete-\d+\.json\)"):
        s = load_spans(aborted)
    assert len(s) == len(SYNC_RUN) and not s.attrs["complete"]
    run = write_run(tmp_path / "trunc", SYNC_RUN[:5])
    sink = SpanSink(str(run / "profile"))
    sink.add(SYNC_RUN[5:])
    sink.close()
    part = sorted((run / "profile").glob("part-*.parquet"))[-1]
    part.write_bytes(part.read_bytes()[:40])
    with pytest.warns(ProfileWarning, match=f"{part.name}: unreadable"):
        s = load_spans(run)
    assert len(s) == 5 and not s.attrs["complete"]


def test_sink_flushes_on_time_and_size(tmp_path):
    sink = SpanSink(str(tmp_path / "profile"), flush_spans=3, flush_s=3600)
    for sp in SYNC_RUN[:7]:
        sink.add([sp])
    assert len(list((tmp_path / "profile").glob("part-*.parquet"))) == 2     # 3 + 3, one still buffered
    assert sink.close()["spans"] == 7
    sink = SpanSink(str(tmp_path / "p2"), flush_s=0.0)
    sink.add(SYNC_RUN[:1])
    assert len(list((tmp_path / "p2").glob("part-*.parquet"))) == 1


# ---- report ---------------------------------------------------------------------------------

def test_profile_report_prints_table_and_writes_plots(tmp_path):
    from pipeline.recorder import Recorder
    from tests.support.runs import step_table

    run = write_run(tmp_path / "run", SYNC_RUN)
    Recorder(run, 2).write(1, step_table(1))
    printed = []
    out = profile_report(run, log=printed.append)
    text = "\n".join(printed)
    assert "AgentFlowRollout" in text and "rows_per_s" in text and "trainer idle" in text
    assert "profiler overhead" in text
    assert set(out["plots"]) == {"gantt", "throughput", "bubbles", "staleness"}
    for p in out["plots"].values():
        assert p.parent == run / "profile_report" and p.read_bytes()[:4] == b"\x89PNG"
    assert out["bubbles"]["trainer_idle_s"].sum() == pytest.approx(8.2)
    from pipeline.cli import main

    assert main(["profile", str(tmp_path / "missing")]) == 2
    assert np.isfinite(out["stages"]["rows_per_s"]).all()


def test_profile_without_plotting_libraries_says_what_to_install(tmp_path, monkeypatch, capsys):
    from pipeline.cli import main

    run = write_run(tmp_path / "run", SYNC_RUN)
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # not installed, as importlib sees it
    printed = []
    out = profile_report(run, log=printed.append)
    assert "AgentFlowRollout" in "\n".join(printed) and out["plots"] == {}
    assert printed[-1] == 'no plots: matplotlib is not installed (pip install -e ".[profile]")'
    monkeypatch.setitem(sys.modules, "pandas", None)
    assert main(["profile", str(run)]) == 2
    assert capsys.readouterr().err.strip() == 'error: loongsage profile needs pandas (pip install -e ".[profile]")'
