"""Profiler: a span for every stage call and every driver phase -> RUN_DIR/profile/*.parquet.

A span (SPAN_SCHEMA) is one piece of work on one actor ("Reward:4711" = stage : pid, or "driver", "trainer",
"engines"): a stage call, or a driver phase (batcher: waiting for the next step's groups; update, sync, eval).
`batch_id` (the first group seq) follows one block through the stages; `wait_s` is the actor's idle time before
the span, `overhead_s` the profiler's own time recording the actor's previous one.

Recording stays on: a stage call costs two clock reads, a few Arrow reductions and a fire-and-forget
call to a `SpanSink` actor, which writes a Parquet part every few seconds; `close()` marks the session
complete with `_complete-*.json`. Reading spans back is pipeline/planner/spans.py.
"""
from __future__ import annotations

import inspect
import itertools
import json
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.recorder import write_atomic

SPAN_SCHEMA = pa.schema([
    ("stage", pa.string()), ("actor", pa.string()), ("step", pa.int64()), ("batch_id", pa.int64()),
    ("rows_in", pa.int64()), ("rows_out", pa.int64()), ("tokens", pa.int64()),
    ("start", pa.float64()), ("end", pa.float64()), ("wait_s", pa.float64()), ("overhead_s", pa.float64()),
])
_SESSIONS = itertools.count()


class SpanSink:
    """Buffers spans from every actor; writes `part-<session>-<k>.parquet` every `flush_s` or `flush_spans`."""

    def __init__(self, out_dir: str, flush_spans: int = 2048, flush_s: float = 5.0):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # a resumed run's parts sort after the first run's; pid + counter: two sinks in one millisecond differ
        self.session = f"{int(time.time() * 1000)}{os.getpid():07d}{next(_SESSIONS):04d}"
        self.flush_spans, self.flush_s = flush_spans, flush_s
        self.buf: list[dict] = []
        self.parts = self.count = 0
        self.busy_s, self.last_flush = 0.0, time.time()

    def add(self, spans: list[dict], force: bool = False) -> None:
        t0 = time.perf_counter()
        self.buf.extend(spans)
        if force or len(self.buf) >= self.flush_spans or time.time() - self.last_flush >= self.flush_s:
            self.flush()
        self.busy_s += time.perf_counter() - t0

    def flush(self) -> None:
        self.last_flush = time.time()
        if self.buf:
            name = f"part-{self.session}-{self.parts:05d}.parquet"
            write_atomic(pa.Table.from_pylist(self.buf, schema=SPAN_SCHEMA), self.dir / name)
            self.count += len(self.buf)
            self.parts += 1
            self.buf = []

    def close(self) -> dict:
        self.add([], force=True)
        summary = {"session": self.session, "spans": self.count, "parts": self.parts, "sink_busy_s": self.busy_s}
        (self.dir / f"_complete-{self.session}.json").write_text(json.dumps(summary))
        return summary


class _Clock:
    """Per actor: idle time between calls, in-flight calls (threaded actors), the last span's cost."""

    def __init__(self, stage: str, actor: str, send):
        self.stage, self.actor, self.send = stage, actor, send
        self.idle_since, self.inflight, self.overhead = time.time(), 0, 0.0
        self.lock = threading.Lock()

    def begin(self) -> tuple[float, float]:
        with self.lock:
            t = time.time()
            wait = t - self.idle_since if self.inflight == 0 else 0.0
            self.inflight += 1
        return t, wait

    def end(self, batch, out, start: float, wait: float) -> None:
        end, t = time.time(), time.perf_counter()
        with self.lock:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle_since = end
        self.emit(t, stage=self.stage, start=start, end=end, wait_s=wait, **_counts(batch, out))

    def emit(self, t_begin: float, **span) -> None:
        """Send one span; what recording it cost is measured here and carried by the next span."""
        self.send([{"actor": self.actor, "step": -1, "batch_id": -1, "rows_in": 0, "rows_out": 0, "tokens": 0,
                    "wait_s": 0.0} | span | {"overhead_s": self.overhead}])
        self.overhead = time.perf_counter() - t_begin


def _counts(batch, out) -> dict:
    """The batch's first group seq (-1: none), rows in and out, response tokens out (either may be None)."""
    cols_in, cols_out = getattr(batch, "column_names", ()), getattr(out, "column_names", ())
    first = "group_id" in cols_in and batch.num_rows > 0
    return {"batch_id": int(pc.min(batch.column("group_id")).as_py()) if first else -1,
            "rows_in": int(getattr(batch, "num_rows", 0)), "rows_out": int(getattr(out, "num_rows", 0)),
            "tokens": int(pc.sum(pc.list_value_length(out.column("response_ids"))).as_py() or 0)
            if "response_ids" in cols_out else 0}


def profiled(cls: type, profiler: "Profiler | None") -> type:
    """`cls` as a map stage recording a span per call (`cls` itself without a profiler): a subclass with
    the same constructor and columns, pickled with the sink's handle so each actor sends its own spans."""
    if profiler is None:
        return cls
    name, call, send = getattr(cls, "__name__", "stage"), cls.__call__, profiler.send

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        self._span_clock = _Clock(name, f"{name}:{os.getpid()}", send)

    def __call__(self, batch):
        start, wait = self._span_clock.begin()
        out = None
        try:
            out = call(self, batch)
            return out
        finally:
            self._span_clock.end(batch, out, start, wait)

    async def __acall__(self, batch):
        start, wait = self._span_clock.begin()
        out = None
        try:
            out = await call(self, batch)
            return out
        finally:
            self._span_clock.end(batch, out, start, wait)

    body = __acall__ if inspect.iscoroutinefunction(call) else __call__
    return type(name, (cls,), {"__init__": __init__, "__call__": body, "__doc__": cls.__doc__})


class Profiler:
    """Driver side: owns the sink (a Ray actor, or an in-process object with remote=False) and records driver spans."""

    def __init__(self, run_dir: str | Path, remote: bool = True):
        out = str(Path(run_dir) / "profile")
        if remote:
            import ray

            from pipeline.cluster import on_driver_node

            self.sink = ray.remote(SpanSink).options(num_cpus=0, **on_driver_node()).remote(out)
            self.send = self.sink.add.remote
        else:
            self.sink = SpanSink(out)
            self.send = self.sink.add
        self._clocks: dict[str, _Clock] = {}

    def add(self, stage: str, start: float, end: float, *, actor: str = "driver", step: int = -1,
            rows_in: int = 0, rows_out: int = 0, tokens: int = 0) -> None:
        t = time.perf_counter()
        clock = self._clocks.get(actor) or self._clocks.setdefault(actor, _Clock(stage, actor, self.send))
        wait = max(0.0, start - clock.idle_since)
        clock.idle_since = max(clock.idle_since, end)
        clock.emit(t, stage=stage, start=start, end=end, step=step, rows_in=rows_in, rows_out=rows_out,
                   tokens=tokens, wait_s=wait)

    def close(self) -> dict:
        """Flush everything and mark the profile complete; returns the sink's summary."""
        if isinstance(self.sink, SpanSink):
            return self.sink.close()
        import ray

        summary = ray.get(self.sink.close.remote())
        ray.kill(self.sink)
        return summary
