"""The step loop, one for a run and for a replay:

    for each step:
        batch   = next step table                 (the batcher took it during the previous update)
        metrics = train(batch)                    (the previous step's bookkeeping runs meanwhile)
        version += 1; publish(version)            (weights to every engine)
        window moves on (batch's groups, version) (rollout may run ahead again)
        checkpoint, when due
        bookkeeping(step, batch, metrics)         (deferred: runs during the next update)

What the loop trains on and where the weights go are its `StepParts`; what overlaps what is
`Overlap`, the one object that holds the measured tricks: the next batch is taken on a thread
while the trainer works, the previous step's bookkeeping runs during the update, and in async
mode the next update is queued behind the weight send when its batch is already there.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import pyarrow as pa


@dataclass
class Batch:
    """One step's table, as the step loop holds it."""
    table: pa.Table
    ref: Any               # the table in Ray's object store (one chunk per column), or the table itself
    wait_s: float          # how long the batcher waited for the stream to complete it
    version: int = 0       # the weight version it is trained at (set by the loop)
    step: int = 0          # the step it becomes (set by the loop)

    @property
    def groups(self) -> list[int]:
        return sorted(set(self.table.column("group_id").to_pylist()))


@dataclass
class StepParts:
    """What the loop needs from the run around it; replay passes no publish and no window."""
    batches: Iterator[tuple[pa.Table, float]]           # step tables as the batcher completes them
    submit: Callable[[Any], Any]                         # start an update: a ref to its metrics, or the metrics
    record: Callable[[int, Batch, dict], None]           # a trained step's bookkeeping
    publish_begin: Callable[[int], Any] | None = None    # -> a handle with .sender_free
    publish_end: Callable[[Any], dict] | None = None     # -> the sync's metrics
    window_moved: Callable[[Batch, int], None] = lambda batch, version: None
    checkpoint: Callable[[set[int]], None] = lambda untrained: None
    lock: ContextManager = field(default_factory=contextlib.nullcontext)   # held from update to checkpoint
    release: Callable[[], None] = lambda: None          # unblocks the stream's producers (the window gate)
    put: Callable[[pa.Table], Any] = lambda table: table   # how a taken table is shipped (ray.put)
    span: Callable[..., None] = lambda *a, **kw: None      # profiler.add(name, t0, t1, **fields)


class StepLoop:
    def __init__(self, parts: StepParts, steps: int, *, step: int = 0, version: int = 0,
                 queue_next: bool = False, checkpoint_every: int = 0):
        self.parts, self.steps, self.step, self.version = parts, steps, step, version
        self.checkpoint_every = checkpoint_every
        self.overlap = Overlap(parts, queue_next)
        self.stop = threading.Event()         # set (e.g. on SIGINT): the loop ends after the step in hand
        self._in_hand = False                 # a batch is being trained (its step not yet counted)
        self._closed = False

    def run(self) -> int:
        """Train until `steps`, the stream's end or `stop`; returns the steps done."""
        o, p = self.overlap, self.parts
        o.start()
        try:
            while self.step < self.steps and (o.queued or not self.stop.is_set()):    # a queued update is finished
                batch = o.next_batch(self.stop)
                if batch is None:
                    break
                self._in_hand = True
                with p.lock:                  # a restarted engine is re-sent weights between steps, not mid-update
                    batch.version, batch.step = self.version, self.step + 1
                    metrics = o.train(batch)                    # the previous step's bookkeeping runs meanwhile
                    self.version += 1
                    self.step += 1
                    self._in_hand = False
                    metrics |= o.publish(self.version, self._may_queue_next())
                    p.window_moved(batch, self.version)
                    if self._checkpoint_due():
                        p.checkpoint(o.untrained())             # before the next step touches the weights
                o.defer(self.step, batch, metrics)
            o.finish()
        finally:
            self.close()
        return self.step

    def last_step(self) -> int:
        """The last step trained if `stop` is set now: the step in hand and a queued update finish; a batch
        still being rolled out is not waited for."""
        return self.step + int(self._in_hand) + int(self.overlap.queued)

    def close(self) -> None:
        """Stop the stream: its producers are released first, so the prefetch thread can end."""
        if not self._closed:
            self._closed = True
            self.parts.release()
            self.overlap.close()

    def _checkpoint_due(self) -> bool:
        return bool(self.checkpoint_every and self.step % self.checkpoint_every == 0)

    def _may_queue_next(self) -> bool:
        """Not after a checkpoint's step or the final one (their weights must stay put until saved
        or evaluated), and not once stopping (the step in hand is the last)."""
        return not (self._checkpoint_due() or self.step >= self.steps or self.stop.is_set())

    def untrained(self) -> set[int]:
        return self.overlap.untrained()


class Overlap:
    """What runs during an update, and when the next update is queued behind the weight send.

    * The next batch is taken on a thread (`Prefetch`) while the trainer works, and shipped to
      the object store there, so nothing sits between one update and the next submit.
    * The previous step's bookkeeping (recorder, metrics, periodic eval) runs after this step's
      update was submitted, while the trainer computes.
    * `queue_next` (async mode): when the sender is free as soon as its send call ran and the
      next batch is already there, the next update is submitted right after the send started;
      the trainer starts it the moment its part of the publish is done, while engines still land.
      Not on a checkpoint's or the final step, whose weights must stay put.
    """

    def __init__(self, parts: StepParts, queue_next: bool):
        self.parts, self.queue_next = parts, queue_next
        self.prefetch: Prefetch | None = None      # started by the loop's run, not before
        self._pending: tuple[Batch, Any] | None = None      # a queued update: its batch and its ref
        self._deferred: tuple[int, Batch, dict] | None = None
        self._ended = False

    def start(self) -> None:
        """Start taking batches (the stream's rollout begins now)."""
        if self.prefetch is None:
            self.prefetch = Prefetch(self.parts.batches, self.parts.put)

    @property
    def queued(self) -> bool:
        """The next update was submitted already (behind the weight send)."""
        return self._pending is not None

    def next_batch(self, stop: threading.Event | None = None) -> Batch | None:
        """The queued update's batch, else the next from the prefetch thread (None: the stream ended)."""
        if self._pending is not None:
            return self._pending[0]
        if self._ended:
            return None
        t = time.time()
        while True:
            got = self.prefetch.get(timeout=0.2 if stop is not None else None)
            if got is not Prefetch.NOT_YET or (stop is not None and stop.is_set()):
                break
        if got is None or got is Prefetch.NOT_YET:
            self._ended = got is None
            return None
        table, ref, _ = got
        return Batch(table, ref, time.time() - t)     # the step loop's wait: the stream's lag behind the trainer

    def train(self, batch: Batch) -> dict:
        """Run the update on `batch` (submitted now unless it was queued); returns its metrics."""
        t0 = time.time()
        self.parts.span("batcher", t0 - batch.wait_s, t0, step=batch.step, rows_out=batch.table.num_rows)
        ref = self._pending[1] if self._pending is not None else self.parts.submit(batch.ref)
        queued, self._pending = self._pending is not None, None
        self._run_deferred()
        metrics = _resolve(ref)
        t1 = self._t_update_end = time.time()
        self._step = batch.step
        self.prefetch.trained()
        self.parts.span("update", t0, t1, actor="trainer", step=batch.step, rows_in=batch.table.num_rows,
                        tokens=int(metrics.get("train/tokens", 0)))
        return dict(metrics) | {"time/rollout_wait_s": 0.0 if queued else batch.wait_s, "time/update_s": t1 - t0}

    def publish(self, version: int, may_queue_next: bool) -> dict:
        """The new version to every receiver; queues the next update behind the send when it may."""
        p = self.parts
        if p.publish_begin is None:
            return {}
        publishing = p.publish_begin(version)
        if self.queue_next and may_queue_next and getattr(publishing, "sender_free", False):
            self._queue_next()
        m = p.publish_end(publishing)
        t2 = time.time()
        p.span("sync", self._t_update_end, t2, actor="trainer", step=self._step)
        return m | {"time/sync_s": t2 - self._t_update_end, "time/next_update_queued": float(self._pending is not None)}

    def _queue_next(self) -> None:
        got = self.prefetch.get(timeout=0.0)
        if got is None:
            self._ended = True
        elif got is not Prefetch.NOT_YET:
            table, ref, _ = got
            self._pending = (Batch(table, ref, 0.0), self.parts.submit(ref))

    def defer(self, step: int, batch: Batch, metrics: dict) -> None:
        self._run_deferred()
        self._deferred = (step, batch, metrics)

    def _run_deferred(self) -> None:
        if self._deferred is not None:
            args, self._deferred = self._deferred, None
            self.parts.record(*args)

    def finish(self) -> None:
        """The last step's bookkeeping."""
        self._run_deferred()

    def untrained(self) -> set[int]:
        return self.prefetch.untrained() if self.prefetch is not None else set()

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()


def _resolve(ref) -> dict:
    if isinstance(ref, dict):
        return ref
    import ray

    return ray.get(ref)


class Prefetch:
    """Takes the next step's batch while the trainer works on this one.

    A thread iterates the batch stream (Ray Data rollout -> batcher) and hands over one table at
    a time, already shipped by `put`, so the trainer's next update is submitted the moment the
    previous one is published: no serialisation, no batcher work and no bookkeeping sits between
    two updates. At most one table waits here, taken at the version it will be trained at, so the
    staleness bound holds as if taken just in time."""

    _END = object()
    NOT_YET = object()

    def __init__(self, batches, put: Callable[[pa.Table], Any]):
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._untrained: list[set[int]] = []
        self._put_fn = put
        self._thread = threading.Thread(target=self._run, args=(batches,), name="prefetch", daemon=True)
        self._thread.start()

    def _run(self, batches) -> None:
        item = self._END
        try:
            for table, wait_s in batches:
                with self._lock:
                    self._untrained.append(set(table.column("group_id").to_pylist()))
                if not self._put((table, self._put_fn(table), wait_s)):
                    return
        except BaseException as e:     # noqa: BLE001 - re-raised in the step loop
            item = e
        finally:
            if hasattr(batches, "close"):
                batches.close()
            self._put(item)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def get(self, timeout: float | None = None):
        """The next (table, shipped table, seconds the batcher waited), None at the end, or
        NOT_YET when `timeout` passed first."""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return self.NOT_YET
        if isinstance(item, BaseException):
            raise item
        return None if item is self._END else item

    def trained(self) -> None:
        with self._lock:
            self._untrained.pop(0)

    def untrained(self) -> set[int]:
        """Group ids of batches taken but not trained yet."""
        with self._lock:
            return set().union(*self._untrained)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Stop taking batches; False if the stream's producer still held the thread after
        `timeout_s` (it is a daemon thread: it does not keep the process alive)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._q.get(timeout=0.1)
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)
        return not self._thread.is_alive()
